"""fused_logp under bad and edge inputs (issue 22): a meta tensor mixed with real ones fails as the ops' checks do (the
fakes run them), second derivatives raise instead of coming out as zero, and the public functions name the argument
a mistake is in. The fuzz-style sweep over every public function and raw op: tests/test_fused_logp_fuzz.py."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from prime_kernels_core.testing import kernel_module

# Its sweeps call both kernels' ops side by side (the raw-op cases are built at collection): where linear_logp cannot
# run, the file skips with the registry's sentence.
linear_ops = kernel_module("linear_logp", "prime_kernels_fused_logp.linear_ops")
from prime_kernels_fused_logp.linear_ops import linear_logp_entropy, linear_logp_entropy_backward  # noqa: E402
from prime_kernels_fused_logp.ops import logp_entropy  # noqa: E402

SEED = int(os.environ.get("FUSED_LOGP_TEST_SEED", time.time_ns() % 2**31))
N, V, H = 6, 40, 16
ops = torch.ops.fused_logp


def raw_op_calls():
    """(name, op, args) of every fused_logp op on valid CPU arguments."""
    logits = torch.randn(N, V)
    labels = torch.randint(0, V, (N,))
    tt = torch.rand(N) + 0.5
    _, _, stats = ops.logp_entropy(logits, labels, 1.0, tt, -100, True, True)
    hid, w, b = torch.randn(N, H), torch.randn(V, H), torch.randn(V)
    _, _, lstats = ops.linear_logp_entropy(hid, w, labels, 1.0, tt, b, -100, True)
    g = torch.randn(N)
    return [
        ("logp_entropy", ops.logp_entropy, [logits, labels, 1.0, tt, -100, True, True]),
        ("logp_entropy_backward", ops.logp_entropy_backward, [g, g.clone(), logits, labels, 1.0, tt, stats, -100]),
        ("linear_logp_entropy", ops.linear_logp_entropy, [hid, w, labels, 1.0, tt, b, -100, True]),
        ("linear_logp_entropy_backward", ops.linear_logp_entropy_backward,
         [g, g.clone(), hid, w, labels, 1.0, tt, b, lstats, -100, [True, True, True], False]),
    ]


def meta_cases():
    return [pytest.param(op, args, i, id=f"{name}-arg{i}") for name, op, args in raw_op_calls()
            for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("op, args, index", meta_cases())
def test_raw_op_with_one_meta_tensor_raises(op, args, index):
    """The dispatcher runs the fake for a meta tensor among CPU ones: it must raise, naming the device mismatch."""
    args = list(args)
    args[index] = args[index].to("meta")
    with pytest.raises(RuntimeError, match=r"on (logits'|hidden's) device (cpu|meta), got (meta|cpu)"):
        op(*args)


@pytest.mark.parametrize("name", ["grad_logp", "grad_entropy", "hidden", "weight", "stats"])
def test_linear_logp_entropy_backward_with_one_meta_tensor_raises(name):
    hid, w, labels = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    _, _, stats = ops.linear_logp_entropy(hid, w, labels, 1.0, None, None, -100, True)
    args = dict(grad_logp=torch.randn(N), grad_entropy=torch.randn(N), hidden=hid, weight=w, stats=stats)
    args[name] = args[name].to("meta")
    with pytest.raises((RuntimeError, ValueError), match=r"device (cpu|meta), got (meta|cpu)"):
        linear_logp_entropy_backward(args["grad_logp"], args["grad_entropy"], args["hidden"], args["weight"], labels,
                                     stats=args["stats"])


@pytest.mark.parametrize("name, index, bad", [
    ("logp_entropy", 0, lambda t: t.double()),
    ("logp_entropy", 1, lambda t: t[:-1]),
    ("logp_entropy", 3, lambda t: t.double()),
    ("logp_entropy_backward", 6, lambda t: t.float()),
    ("logp_entropy_backward", 1, lambda t: t[:, None]),
    ("linear_logp_entropy", 1, lambda t: t[:, :-1]),
    ("linear_logp_entropy", 5, lambda t: t[:-1]),
    ("linear_logp_entropy_backward", 8, lambda t: t.float()),
    ("linear_logp_entropy_backward", 0, lambda t: t[:-1]),
])
def test_fake_raises_what_the_op_raises(name, index, bad):
    op, args = next((op, list(args)) for n, op, args in raw_op_calls() if n == name)
    args[index] = bad(args[index])
    real, fake = _real_and_fake_messages(op, args)
    assert real == fake


def _real_and_fake_messages(op, args):
    """The first line of the RuntimeError the op raises on real tensors, and on the same arguments as fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def message(call):
        with pytest.raises(RuntimeError) as info:
            call()
        return str(info.value).split("\n")[0]

    real = message(lambda: op(*args))
    with FakeTensorMode() as mode:
        fake = message(lambda: op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]))
    return real, fake


# ---- second derivatives -----------------------------------------------------------------------------------------
def _second_backward_raises(first, leaves, what):
    grads = torch.autograd.grad(first, leaves, create_graph=True)
    with pytest.raises(RuntimeError, match=f"{what}: double backward is not supported"):
        sum(g.square().sum() for g in grads).backward()


def test_logp_entropy_double_backward_raises():
    logits = torch.randn(N, V, requires_grad=True)
    logp, ent = logp_entropy(logits, torch.randint(0, V, (N,)), 0.7)
    _second_backward_raises((logp + ent).sum(), [logits], "logp_entropy")


@pytest.mark.parametrize("fallback", [None, "chunked"])
def test_linear_logp_entropy_double_backward_raises(fallback):
    hid, w = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    logp, ent = linear_logp_entropy(hid, w, torch.randint(0, V, (N,)), 0.7, fallback=fallback)
    # the chunked fallback goes through logp_entropy: its backward op refuses
    what = "linear_logp_entropy" if fallback is None else "logp_entropy"
    _second_backward_raises((logp + ent).sum(), [hid, w], what)


def test_raw_backward_op_double_backward_raises():
    hid, w, labels = torch.randn(N, H, requires_grad=True), torch.randn(V, H), torch.randint(0, V, (N,))
    _, _, stats = ops.linear_logp_entropy(hid.detach(), w, labels, 1.0, None, None, -100, True)
    gh, _, _ = linear_logp_entropy_backward(torch.randn(N), torch.randn(N), hid, w, labels, stats=stats,
                                            needs=(True, False, False))
    with pytest.raises(RuntimeError, match="linear_logp_entropy: double backward is not supported"):
        gh.square().sum().backward()


def test_first_order_gradient_under_create_graph_is_unchanged():
    logits = torch.randn(N, V, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    plain = torch.autograd.grad(logp_entropy(logits, labels)[0].sum(), logits)[0]
    graphed = torch.autograd.grad(logp_entropy(logits, labels)[0].sum(), logits, create_graph=True)[0]
    torch.testing.assert_close(plain, graphed.detach(), rtol=0, atol=0)


# ---- the unclear errors -----------------------------------------------------------------------------------
NOT_TENSORS = [[[1.0, 2.0]], np.zeros((N, V), dtype=np.float32), None, "logits"]


@pytest.mark.parametrize("value", NOT_TENSORS, ids=["list", "numpy", "None", "str"])
@pytest.mark.parametrize("position", ["logits", "labels"])
def test_logp_entropy_names_a_non_tensor(value, position):
    args = dict(logits=torch.randn(N, V), labels=torch.randint(0, V, (N,)))
    args[position] = value
    with pytest.raises(TypeError, match=f"logp_entropy: {position} must be a torch.Tensor, got"):
        logp_entropy(**args)


@pytest.mark.parametrize("value", NOT_TENSORS, ids=["list", "numpy", "None", "str"])
@pytest.mark.parametrize("position", ["hidden", "weight", "labels", "bias"])
def test_linear_logp_entropy_names_a_non_tensor(value, position):
    args = dict(hidden=torch.randn(N, H), weight=torch.randn(V, H), labels=torch.randint(0, V, (N,)), bias=None)
    if value is None and position == "bias":
        return  # no bias is valid
    args[position] = value
    with pytest.raises(TypeError, match=f"linear_logp_entropy: {position} must be a torch.Tensor"):
        linear_logp_entropy(args["hidden"], args["weight"], args["labels"], bias=args["bias"])


@pytest.mark.parametrize("temperature", [[1.0], np.float32(1.0) * np.ones(N), None, "1.0", True],
                         ids=["list", "numpy", "None", "str", "bool"])
def test_temperatures_of_the_wrong_kind_are_named(temperature):
    logits, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    with pytest.raises(TypeError, match="logp_entropy: temperature must be a real number or a floating-point tensor"):
        logp_entropy(logits, labels, temperature)
    with pytest.raises(TypeError, match="linear_logp_entropy: temperature must be a real number or a floating-point tensor"):
        linear_logp_entropy(torch.randn(N, H), torch.randn(V, H), labels, temperature)


def test_temperature_tensor_of_another_dtype_names_temperature():
    """Floating temperature tensors of any dtype are used as float32 (the one rule of both ops); others are named."""
    logits, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    got, want = logp_entropy(logits, labels, torch.full((N,), 0.7, dtype=torch.float64)), logp_entropy(logits, labels, 0.7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="temperature tensor must be floating point") as info:
        logp_entropy(logits, labels, torch.ones(N, dtype=torch.int64))
    assert "token_temperature" not in str(info.value)


@pytest.mark.parametrize("name, softcap, logit_scale", [
    ("logp_entropy", -1.0, 1.0),
    ("logp_entropy_backward", None, 0.0),
    ("linear_logp_entropy", float("inf"), 1.0),
    ("linear_logp_entropy_backward", None, -2.0),
])
def test_fake_raises_what_the_op_raises_for_transforms(name, softcap, logit_scale):
    op, args = next((op, list(args)) for n, op, args in raw_op_calls() if n == name)
    real, fake = _real_and_fake_messages(op, args + [False, softcap, logit_scale])  # batch_invariant, transforms
    assert real == fake and ("softcap" in real or "logit_scale" in real)


@pytest.mark.parametrize("ignore_index, error", [(2**64, ValueError), (-(2**63) - 1, ValueError), (1.5, TypeError),
                                                 ("-100", TypeError)])
def test_ignore_index_out_of_int64_or_not_an_int_is_named(ignore_index, error):
    labels = torch.randint(0, V, (N,))
    with pytest.raises(error, match="logp_entropy: ignore_index must"):
        logp_entropy(torch.randn(N, V), labels, ignore_index=ignore_index)
    with pytest.raises(error, match="linear_logp_entropy: ignore_index must"):
        linear_logp_entropy(torch.randn(N, H), torch.randn(V, H), labels, ignore_index=ignore_index)


@pytest.mark.parametrize("group", ["x", 0, object()], ids=["str", "int", "object"])
def test_process_group_that_is_not_one_is_named(group):
    labels = torch.randint(0, V, (N,))
    with pytest.raises(TypeError, match="logp_entropy: process_group must be a torch.distributed ProcessGroup"):
        logp_entropy(torch.randn(N, V), labels, process_group=group)
    with pytest.raises(TypeError, match="linear_logp_entropy: process_group must be a torch.distributed ProcessGroup"):
        linear_logp_entropy(torch.randn(N, H), torch.randn(V, H), labels, process_group=group)


@pytest.mark.parametrize("fallback", [None, "chunked"])
def test_float64_hidden_is_refused_without_suggesting_the_fallback(fallback):
    with pytest.raises(TypeError, match="hidden must be bfloat16 or float16 .* got torch.float64") as info:
        linear_logp_entropy(torch.randn(N, H).double(), torch.randn(V, H).double(), torch.randint(0, V, (N,)),
                            fallback=fallback)
    assert "pass fallback" not in str(info.value)


def test_chunked_fallback_for_float32_still_runs():
    """What the dtype check must keep: float32 through the chunked fallback (the CUDA kernel's dtypes are 16-bit)."""
    hid, w, labels = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    got = linear_ops._chunked(hid, w, labels, 1.0, None, None, -100, 16)
    want = linear_logp_entropy(hid, w, labels)
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize("value", ["no", torch.tensor(True), 1, None], ids=["str", "tensor", "int", "None"])
@pytest.mark.parametrize("flag", ["return_entropy", "check_labels", "batch_invariant"])
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(flag, value):
    """ "no" would read as True, a tensor as its truth (issue 61, item 10)."""
    logits, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    with pytest.raises(TypeError, match=f"logp_entropy: {flag} must be True or False, got"):
        logp_entropy(logits, labels, 0.7, **{flag: value})
    if flag != "check_labels":
        with pytest.raises(TypeError, match=f"linear_logp_entropy: {flag} must be True or False, got"):
            linear_logp_entropy(torch.randn(N, H), torch.randn(V, H), labels, 0.7, **{flag: value})


@pytest.mark.parametrize("number", [np.float32(0.7), np.float64(0.7), np.float16(0.7), np.int64(1)],
                         ids=["float32", "float64", "float16", "int64"])
def test_numpy_scalars_are_real_numbers(number):
    """A temperature, softcap or logit_scale read from a NumPy config is accepted as its value (issue 61, item 10)."""
    logits, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    want = logp_entropy(logits, labels, float(number), softcap=float(number) * 4, logit_scale=float(number))
    got = logp_entropy(logits, labels, number, softcap=number * 4, logit_scale=number)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    torch.testing.assert_close(linear_logp_entropy(hidden, weight, labels, number, logit_scale=number),
                               linear_logp_entropy(hidden, weight, labels, float(number), logit_scale=float(number)),
                               rtol=0, atol=0)
