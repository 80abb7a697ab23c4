"""residual_rmsnorm under bad inputs (issue 22): a meta tensor mixed with CPU ones fails as the op's checks do (the
fake runs them) instead of returning uninitialised memory; non-tensors are named."""
import pytest
import torch

from prime_kernels_core.testing import kernel_module

residual_rmsnorm = kernel_module("residual_rmsnorm", "pk_example_rmsnorm.ops").residual_rmsnorm
pytestmark = pytest.mark.kernel("residual_rmsnorm", device="cpu")


def _args():
    return [torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)]


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("call", [residual_rmsnorm, torch.ops.pk_example.residual_rmsnorm],
                         ids=["public", "raw op"])
def test_one_meta_tensor_raises(call, index):
    args = _args()
    args[index] = args[index].to("meta")
    with pytest.raises(RuntimeError, match=r"residual_rmsnorm: (residual|weight) must be on x's device (cpu|meta), "
                                           r"got (meta|cpu)"):
        call(*args, 1e-6)


@pytest.mark.parametrize("index, bad, words", [
    (1, lambda t: t[:, :4], r"residual must have x's shape \[3, 8\], got \[3, 4\]"),
    (2, lambda t: t.double(), "weight must have x's dtype Float, got Double"),
    (2, lambda t: t[:4], r"weight must have shape \[8\]"),
    (0, lambda t: t.int(), "x must be float32, float64, float16 or bfloat16, got Int"),
])
def test_fake_raises_what_the_op_raises(index, bad, words):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _args()
    args[index] = bad(args[index])
    with pytest.raises(RuntimeError, match=words):
        torch.ops.pk_example.residual_rmsnorm(*args, 1e-6)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        with pytest.raises(RuntimeError, match=words):
            torch.ops.pk_example.residual_rmsnorm(*fake, 1e-6)


@pytest.mark.parametrize("value", [[1.0] * 8, None, "x"], ids=["list", "None", "str"])
@pytest.mark.parametrize("index, name", [(0, "x"), (1, "residual"), (2, "weight")])
def test_non_tensors_are_named(value, index, name):
    args = _args()
    args[index] = value
    with pytest.raises(TypeError, match=f"residual_rmsnorm: {name} must be a torch.Tensor"):
        residual_rmsnorm(*args)
    with pytest.raises(TypeError, match="residual_rmsnorm: eps must be a float"):
        residual_rmsnorm(*_args(), eps="1e-6")
