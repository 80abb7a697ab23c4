"""bench/peer_moe.py's adapters hand each MoE peer our problem (issue 62): on small float64 tensors, the peer's
documented contract (its torch formulation) applied to what the adapter builds equals our float64 reference on the
same weights and routing; a swapped gate/up does not (the check can fail)."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from prime_kernels_flash_moe.reference import moe_per_expert

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import peer_moe  # noqa: E402

T, E, K, DIM, HIDDEN = 24, 5, 2, 16, 12


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, DIM, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, HIDDEN, DIM, generator=g, dtype=torch.float64) / DIM**0.5
    w3 = torch.randn(E, HIDDEN, DIM, generator=g, dtype=torch.float64) / DIM**0.5
    w2 = torch.randn(E, DIM, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    ids = torch.rand(T, E, generator=g).topk(K, -1).indices.to(torch.int32)
    tw = torch.rand(T, K, generator=g, dtype=torch.float64).softmax(-1)
    return x, w1, w2, w3, ids, tw


def close(a, b):
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_liger_triton_args_describe_our_moe():
    x, w1, w2, w3, ids, tw = problem()
    ours = moe_per_expert(x, w1, w2, w3, ids, tw)
    args = peer_moe.liger_triton_args(x, peer_moe.stack_gate_up(w1, w3), w2, ids, tw)
    assert args[1].shape == (E, 2 * HIDDEN, DIM) and args[3].dtype == torch.int32
    assert close(peer_moe.liger_triton_formulation(*args), ours)
    swapped = peer_moe.liger_triton_args(x, peer_moe.stack_gate_up(w3, w1), w2, ids, tw)
    assert not close(peer_moe.liger_triton_formulation(*swapped), ours)


def test_lck_args_describe_our_moe():
    x, w1, w2, w3, ids, tw = problem(1)
    ours = moe_per_expert(x, w1, w2, w3, ids, tw)
    args = peer_moe.lck_args(x, w1, w2, w3, ids, tw)
    assert args[2].dtype == torch.bfloat16 and args[1].dtype == torch.int32 and args[6:] == (E, K)
    # the routing weights go to the peer in bf16: judge the rest exactly with those weights
    ours_bf16_weights = moe_per_expert(x, w1, w2, w3, ids, args[2].double())
    exact = (args[0], args[1], args[2].double(), *args[3:])
    assert close(peer_moe.lck_formulation(*exact), ours_bf16_weights)
    assert (peer_moe.lck_formulation(*exact) - ours).norm() / ours.norm() < 1e-2  # bf16 weights: a rounding apart
    wrong = (*exact[:3], w3, w1, *exact[5:])
    assert not close(peer_moe.lck_formulation(*wrong), ours_bf16_weights)


def test_lck_formulation_names_a_mismatched_top_k():
    x, w1, w2, w3, ids, tw = problem(2)
    args = list(peer_moe.lck_args(x, w1, w2, w3, ids, tw))
    args[7] = K + 1
    with pytest.raises(ValueError, match="top_k"):
        peer_moe.lck_formulation(*args)
