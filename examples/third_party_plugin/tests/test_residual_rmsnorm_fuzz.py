"""Fuzz-style sweep (issue 22): residual_rmsnorm's public functions and raw op, each argument in turn replaced by a
bad or edge value (non-tensors, other dtypes, shapes one off, empty, non-contiguous, meta, NaN; numbers of other kinds
and out of range). Each case must give a clean result, judged against the reference, or a TypeError / ValueError /
RuntimeError whose message names the argument replaced; a crash, any other exception, or a result for a tensor on
another device than the others' fails; prime_kernels_core.fuzz runs the sweep."""
from __future__ import annotations

import pytest

from prime_kernels_core import fuzz

KERNEL = "residual_rmsnorm"


def cpu_targets() -> dict:
    """name -> (callable, valid keyword arguments): small CPU problems, the same in every process."""
    import torch

    from pk_example_rmsnorm import ops

    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(*shape, generator=g) for shape in ((3, 8), (3, 8), (8,)))
    return {
        "residual_rmsnorm": (ops.residual_rmsnorm, dict(x=x, residual=residual, weight=weight, eps=1e-6)),
        "pk_example::residual_rmsnorm": (torch.ops.pk_example.residual_rmsnorm,
                                         dict(x=x, residual=residual, weight=weight, eps=1e-6)),
        "unsupported_shape_reason": (ops.unsupported_shape_reason, dict(hidden_size=8)),
    }


def references() -> dict:
    """name -> (the reference each clean result is judged against, max_ratio): the plain PyTorch computation. The
    targets are fp32, whose error is reduction order, not output rounding: test_residual_rmsnorm.py's room for fp32."""
    from pk_example_rmsnorm import ops

    return {name: (ops.residual_rmsnorm_reference, 2.0)
            for name in ("residual_rmsnorm", "pk_example::residual_rmsnorm")}


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.kernel(KERNEL, device="cpu")),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.kernel(KERNEL)])])
def test_every_bad_input_gets_a_clean_result_or_an_error_naming_the_argument(device):
    failures = fuzz.sweep(__file__, device)
    assert not failures, "\n".join(failures)
