"""The conformance kit catches each kind of non-conforming plugin (throwaway plugins whose ops are defined in Python)."""
import pytest

from prime_kernels_core.testing import assert_conforms

OPS = '''
import torch

lib = torch.library.Library("NAMESPACE", "DEF")
lib.define("op_a(Tensor x) -> Tensor")
lib.impl("op_a", lambda x: x * 2, "CPU")
'''
FAKE = '''
@torch.library.register_fake("NAMESPACE::op_a")
def _fake(x):
    return torch.empty_like(x)
'''
AUTOGRAD = '''
torch.library.register_autograd("NAMESPACE::op_a", lambda ctx, grad: grad * 2)
'''
CONTRACT = '''
def unsupported_shape_reason(n):
    return None
'''
HOOKS = '''
@hookimpl
def prime_kernels_sample_inputs(kernel, device):
    import torch
    return [("op_a", (torch.randn(3, device=device, requires_grad=GRAD),), {})]

@hookimpl
def prime_kernels_surface_samples(kernel, device):
    import torch
    return [(lambda x: torch.ops.NAMESPACE.op_a(x) + 1, (torch.randn(3, device=device, requires_grad=GRAD),), {})]
'''


def _plugin(plugin_dir, dist, ops_source, hooks=HOOKS, trainable=(), **kwargs):
    namespace = "pk_conf_" + dist.replace("-", "_")
    hooks = hooks.replace("NAMESPACE", namespace).replace("GRAD", str(bool(trainable)))
    plugin_dir(dist, namespace=namespace, ops_source=ops_source, hooks=hooks, trainable=trainable, **kwargs)


def test_conforming_plugin_passes(plugin_dir):
    _plugin(plugin_dir, "good", OPS + FAKE + AUTOGRAD + CONTRACT, trainable=("op_a",))
    assert_conforms("demo")


def test_declared_op_not_registered(plugin_dir):
    _plugin(plugin_dir, "missing", OPS + FAKE + CONTRACT, ops=("op_a", "op_b"))
    with pytest.raises(AssertionError, match=r"demo declares ops pk_conf_missing::op_b that importing missing.ops did not register"):
        assert_conforms("demo")


def test_undeclared_op_in_namespace(plugin_dir):
    extra = '\nlib.define("op_c(Tensor x) -> Tensor")\nlib.impl("op_c", lambda x: x, "CPU")\n'
    _plugin(plugin_dir, "extra", OPS + extra + FAKE + CONTRACT)
    with pytest.raises(AssertionError, match=r"undeclared ops \['op_c'\]"):
        assert_conforms("demo")


def test_trainable_op_without_autograd(plugin_dir):
    _plugin(plugin_dir, "noautograd", OPS + FAKE + CONTRACT, trainable=("op_a",))
    with pytest.raises(AssertionError, match="op_a is declared trainable but has no autograd registration"):
        assert_conforms("demo")


def test_op_without_fake(plugin_dir):
    _plugin(plugin_dir, "nofake", OPS + CONTRACT)
    expected = r"^demo: op op_a has no fake implementation; register one with torch\.library\.register_fake$"
    with pytest.raises(AssertionError, match=expected):
        assert_conforms("demo")


BACKWARD_OP = '''
lib.define("op_a_backward(Tensor grad) -> Tensor")
lib.impl("op_a_backward", lambda grad: grad * 2, "CPU")
torch.library.register_autograd("NAMESPACE::op_a", lambda ctx, grad: torch.ops.NAMESPACE.op_a_backward(grad))
'''
BACKWARD_HOOKS = HOOKS.replace(  # the forward's sample first, as a plugin lists them
    "requires_grad=GRAD),), {})]\n", "requires_grad=GRAD),), {}), (\"op_a_backward\", (torch.randn(3, device=device),), {})]\n", 1)


def test_a_backward_op_without_fake_is_named_before_any_opcheck(plugin_dir):
    """Not "test_aot_dispatch_dynamic failed" on the forward op whose backward calls it (issue 61, item 14)."""
    _plugin(plugin_dir, "nobwdfake", OPS + BACKWARD_OP + FAKE + CONTRACT, hooks=BACKWARD_HOOKS,
            ops=("op_a", "op_a_backward"), trainable=("op_a",))
    expected = r"^demo: op op_a_backward has no fake implementation; register one with torch\.library\.register_fake$"
    with pytest.raises(AssertionError, match=expected):
        assert_conforms("demo")


def test_op_without_samples(plugin_dir):
    _plugin(plugin_dir, "nosamples", OPS + FAKE + CONTRACT, hooks="")
    with pytest.raises(AssertionError, match=r"no sample inputs for ops \['op_a'\] on cpu"):
        assert_conforms("demo")


def test_module_without_shape_contract(plugin_dir):
    _plugin(plugin_dir, "nocontract", OPS + FAKE)
    with pytest.raises(AssertionError, match="does not export unsupported_shape_reason"):
        assert_conforms("demo")
