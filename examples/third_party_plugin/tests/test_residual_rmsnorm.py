"""Tests for the example plugin: numerics against float64, the conformance kit, the shape contract, and a GPU run.

Run after installing the wheel: ``python -m pytest examples/third_party_plugin/tests -q -s`` (``-s`` shows the error
ratios). Every test skips, with the reason, when the kernel cannot run where it asks to.
"""
import pytest
import torch

import prime_kernels
from prime_kernels_core import manifest
from prime_kernels_core.testing import assert_conforms, assert_error_ratio

KERNEL = "residual_rmsnorm"
pytestmark = pytest.mark.kernel(KERNEL, device="cpu")


@pytest.fixture(scope="module")
def ops():
    return prime_kernels.load(KERNEL, "cpu")


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x, residual, weight = make(*shape), make(*shape), 1 + 0.5 * make(shape[-1])
    return [t.to(device=device, dtype=dtype) for t in (x, residual, weight)]


# Half-precision outputs round alike on both paths; a different summation order may flip an odd rounding: 2% room.
def _check_forward(ops, shape, dtype, device, eps=1e-6, max_ratio=1.02):
    x, residual, weight = _inputs(shape, dtype, device)
    y, new_residual = ops.residual_rmsnorm(x, residual, weight, eps)
    base_y, base_new = ops.residual_rmsnorm_reference(x, residual, weight, eps)
    ref_y, ref_new = ops.residual_rmsnorm_reference(x.double(), residual.double(), weight.double(), eps)
    assert y.dtype == new_residual.dtype == dtype and y.shape == new_residual.shape == x.shape
    label = f"{device} {dtype} {tuple(shape)}"
    assert_error_ratio(f"{label} new_residual", new_residual, base_new, ref_new, max_ratio)
    assert_error_ratio(f"{label} y", y, base_y, ref_y, max_ratio)


def _grads(fn, x, residual, weight, grad_y, grad_new):
    x, residual, weight = (t.detach().requires_grad_() for t in (x, residual, weight))
    y, new_residual = fn(x, residual, weight, 1e-6)
    torch.autograd.backward((y, new_residual), (grad_y.to(y.dtype), grad_new.to(y.dtype)))
    return x.grad, residual.grad, weight.grad


def _check_backward(ops, shape, dtype, device, max_ratio=1.02):
    x, residual, weight = _inputs(shape, dtype, device)
    grad_y, grad_new = _inputs(shape, dtype, device, seed=1)[:2]
    ours = _grads(ops.residual_rmsnorm, x, residual, weight, grad_y, grad_new)
    base = _grads(ops.residual_rmsnorm_reference, x, residual, weight, grad_y, grad_new)
    ref = _grads(ops.residual_rmsnorm_reference, *(t.double() for t in (x, residual, weight)), grad_y, grad_new)
    for name, a, b, r in zip(("grad x", "grad residual", "grad weight"), ours, base, ref):
        assert a.dtype == dtype
        assert_error_ratio(f"{device} {dtype} {tuple(shape)} {name}", a, b, r, max_ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 7, 512), (3, 1000), (2, 4096)])
def test_forward_cpu_matches_float64(ops, shape, dtype):
    _check_forward(ops, shape, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_cpu_matches_float64(ops, dtype):
    _check_backward(ops, (6, 384), dtype, "cpu")


def test_float64_gradients_are_float64_accurate(ops):
    """float64 is computed in float64 in the backward too (it ran in fp32: gradgradcheck's Jacobians disagreed; issue
    61, item 2): first and second derivatives against finite differences at gradcheck's float64 tolerances."""
    x, residual, weight = (t.requires_grad_() for t in _inputs((3, 16), torch.float64))
    fn = lambda x, residual, weight: ops.residual_rmsnorm(x, residual, weight, 1e-6)
    assert torch.autograd.gradcheck(fn, (x, residual, weight))
    assert torch.autograd.gradgradcheck(fn, (x, residual, weight))


def test_conforms():
    assert_conforms(KERNEL)


def test_shape_contract(ops):
    assert ops.BLOCK_THREADS == manifest.constants("pk_example_rmsnorm", KERNEL)["BLOCK_THREADS"]
    assert ops.unsupported_shape_reason(1) is None and ops.unsupported_shape_reason(4096) is None
    with pytest.raises(prime_kernels.UnsupportedShapeError, match="positive hidden size"):
        prime_kernels.check_shape(ops, 0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, r, w: (x, r[..., :-1], w), "residual must have x's shape"),
        (lambda x, r, w: (x, r.double(), w), "residual must have x's dtype"),
        (lambda x, r, w: (x, r, w[:-1]), r"weight must have shape \[16\]"),
        (lambda x, r, w: (x.int(), r.int(), w.int()), "x must be float32, float64, float16 or bfloat16"),
    ],
)
def test_bad_arguments_name_the_argument(ops, change, message):
    with pytest.raises(RuntimeError, match=message):
        ops.residual_rmsnorm(*change(*_inputs((2, 16), torch.float32)))


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_float64(ops, dtype):
    # fp32's error is reduction order, not output rounding, so its ratio to PyTorch's own reduction gets some room.
    max_ratio = 2.0 if dtype == torch.float32 else 1.02
    for shape in [(1, 1), (5, 100), (3, 7, 1000), (64, 4096), (2, 16384)]:
        _check_forward(ops, shape, dtype, "cuda", max_ratio=max_ratio)
    _check_backward(ops, (33, 2048), dtype, "cuda", max_ratio=max_ratio)
    torch.cuda.synchronize()
