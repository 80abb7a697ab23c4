"""The lm-head peers bench_linear_logp.py --liger times beside linear_logp (issue 62): liger-kernel 0.8.5's CuTe-DSL
SM90 kernels (they need nvidia-cutlass-dsl and a Hopper GPU; bf16 input [M, H] and weight [V, H], int64 target [M]).

- ``LigerFusedLinearCrossEntropySM90Function.apply(input, weight, target, ignore_index, reduction)``: reduction "mean"
  or "sum" only, no "none". "sum" is the closest per-token form: its loss is the sum of every token's NLL and its
  gradients are those of each token's NLL under an upstream gradient of 1, the work ours does for ``logp.sum()``
  (return_entropy=False). No temperature (T = 1); M must be a multiple of 128 and V of 256 (else it raises
  NotImplementedError). Its forward writes the bf16 [M, V] logits once and computes dX; the backward computes dW.
- ``LigerFusedScaledCrossEntropySM90Function.apply(input, weight, target, temperature, ignore_index,
  m_tiles_per_cluster, return_entropy)``: per-token fp32 NLL and, with return_entropy, a differentiable bf16 entropy,
  at a scalar temperature; the logits never reach HBM.

Each peer's contract is written here as a float64 torch formulation (``*_formulation``), for the CPU test
(plugins/fused_logp/tests/test_bench_peer_forms.py) that what we time it against computes the same quantities.
"""
from __future__ import annotations

import torch

FLCE_TILE_M, FLCE_TILE_V = 128, 256  # the shapes LigerFusedLinearCrossEntropySM90Function accepts
LIGER_PUBLISHED = (4096, 4096, 128256)  # M, H, V of Liger's own SM90 benchmarks (Llama 3 8B's lm_head)
FLCE_SUM = "Liger FLCE SM90 (reduction='sum', T=1)"
SCALED_NLL = "Liger scaled CE SM90 (per-token NLL, no entropy, T=1)"
SCALED_ENTROPY = "Liger scaled CE SM90 (per-token NLL + bf16 entropy)"


def flce_accepts(m: int, v: int) -> bool:
    return m % FLCE_TILE_M == 0 and v % FLCE_TILE_V == 0


def _logits(h, w, temperature):
    return (h.double() @ w.double().t()) / temperature


def flce_sum_formulation(h, w, y):
    """LigerFusedLinearCrossEntropySM90Function's loss with reduction="sum": the sum over tokens of
    logsumexp(z) - z_y, z = h @ w.T (no temperature)."""
    z = _logits(h, w, 1.0)
    return (torch.logsumexp(z, -1) - z.gather(1, y[:, None]).squeeze(1)).sum()


def scaled_formulation(h, w, y, temperature, return_entropy):
    """LigerFusedScaledCrossEntropySM90Function's outputs: per-token NLL of softmax(z / T), and its entropy."""
    z = _logits(h, w, temperature)
    lse = torch.logsumexp(z, -1)
    nll = lse - z.gather(1, y[:, None]).squeeze(1)
    if not return_entropy:
        return nll
    return nll, lse - (torch.softmax(z, -1) * z).sum(-1)


def liger_forms(temperature: float) -> dict:
    """label -> (callable(h, w, y) returning a tuple of tensors, the form of ours it is timed against: "no entropy"
    or "entropy"); or label -> the one-line reason it cannot run here."""
    forms = {}
    try:
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import \
            LigerFusedLinearCrossEntropySM90Function as flce

        forms[FLCE_SUM] = (lambda h, w, y: (flce.apply(h, w, y, -100, "sum"),), "no entropy")
    except Exception as exc:  # noqa: BLE001: any import failure is the row's result
        forms[FLCE_SUM] = f"skipped: {type(exc).__name__}: {exc}"
    try:
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import \
            LigerFusedScaledCrossEntropySM90Function as scaled

        forms[SCALED_NLL] = (lambda h, w, y: (scaled.apply(h, w, y, 1.0, -100, 1, False),), "no entropy")
        forms[SCALED_ENTROPY] = (lambda h, w, y: scaled.apply(h, w, y, temperature, -100, 1, True), "entropy")
    except Exception as exc:  # noqa: BLE001
        forms[SCALED_NLL] = forms[SCALED_ENTROPY] = f"skipped: {type(exc).__name__}: {exc}"
    return forms
