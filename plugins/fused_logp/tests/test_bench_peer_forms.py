"""bench/peer_logp.py: what bench_linear_logp.py --liger times Liger's SM90 lm-head kernels against (issue 62) computes
the same quantities as theirs. Their documented contracts (float64 torch formulations) against our float64 reference on
the same random inputs: FLCE's "sum" loss is minus the sum of ours' logp at temperature 1, the scaled kernel's NLL and
entropy are minus ours' logp and ours' entropy at the same temperature; a different temperature does not agree."""
from __future__ import annotations

import pathlib
import sys

import torch

from prime_kernels_fused_logp.reference import logp_entropy_float64

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import peer_logp  # noqa: E402

SEED = 62  # conftest seeds each test from it
N, H, V, T = 20, 16, 40, 0.7


def inputs():
    h = torch.randn(N, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) / H**0.25
    y = torch.randint(0, V, (N,))
    return h, w, y


def ours(h, w, y, temperature):
    return logp_entropy_float64(h @ w.t(), y, temperature)


def test_flce_sum_is_minus_the_sum_of_ours_logp_at_temperature_one():
    h, w, y = inputs()
    logp, _ = ours(h, w, y, 1.0)
    assert torch.allclose(peer_logp.flce_sum_formulation(h, w, y), -logp.double().sum(), rtol=1e-10)
    logp_t, _ = ours(h, w, y, T)
    assert not torch.allclose(peer_logp.flce_sum_formulation(h, w, y), -logp_t.double().sum(), rtol=1e-3)


def test_scaled_forms_are_ours_per_token():
    h, w, y = inputs()
    logp, entropy = ours(h, w, y, T)
    nll, peer_entropy = peer_logp.scaled_formulation(h, w, y, T, True)
    assert torch.allclose(nll, -logp.double(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(peer_entropy, entropy.double(), rtol=1e-10, atol=1e-12)
    logp_1, _ = ours(h, w, y, 1.0)
    assert torch.allclose(peer_logp.scaled_formulation(h, w, y, 1.0, False), -logp_1.double(), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(peer_logp.scaled_formulation(h, w, y, 1.0, False), -logp.double(), rtol=1e-3)


def test_flce_shape_rule_and_the_benchmark_shapes():
    assert peer_logp.flce_accepts(*peer_logp.LIGER_PUBLISHED[::2])
    assert not peer_logp.flce_accepts(8192, 151936)  # the benchmark's V: 151936 = 256 * 593.5
    assert peer_logp.flce_accepts(8192, 152064) and not peer_logp.flce_accepts(8100, 152064)
