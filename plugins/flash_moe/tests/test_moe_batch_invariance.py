"""flash_moe batch invariance (issue 25): ``moe(deterministic=True)``'s output for a token is bitwise the same whether
the token runs alone or among others routed to the same experts (batches of 1, 7, 64, 1500 on CPU; up to 16384 on
CUDA with ``@pytest.mark.gpu``), at random positions, with random neighbours' routes and weights.

Why it holds. CUDA: every routed slot is one row of a 128-slot block of one expert; each output tile (128 slots x 256
columns) is computed by one CTA over the whole K range in order (wgmma m64n256k16, no split-K; the persistent down
GEMM's claimed tiles change which CTA computes a tile, not how), so a slot's gate/up, SwiGLU (rounded to bf16) and
down outputs depend on its own row only; the deterministic combine then sums a token's top_k slots in k order in fp32.
CPU: the expert GEMMs run through at::mm on each expert block, whose per-row result depends on the number of rows for
small blocks (oneDNN/MKL pick other kernels at M <= 8: measured); slot_outputs_cpu therefore pads every block to
BLOCK_M rows, one GEMM shape whatever the batch. Seed printed; BATCH_INVARIANCE_TEST_SEED=<seed> replays.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

SEED = int(os.environ.get("BATCH_INVARIANCE_TEST_SEED", time.time_ns() % 2**31))
CUDA = torch.cuda.is_available()
PROBES = 32  # 8 probes of 256 outputs passed without the CPU padding fix; 32 of 512 caught it
pytestmark = pytest.mark.kernel("flash_moe", device="cpu")  # every test here runs it (on the CPU at least)


def _weights(E, dim, hidden, device, g):
    w1 = (torch.randn(E, hidden, dim, device=device, generator=g) / dim**0.5).bfloat16()
    w3 = (torch.randn(E, hidden, dim, device=device, generator=g) / dim**0.5).bfloat16()
    w2 = (torch.randn(E, dim, hidden, device=device, generator=g) / hidden**0.5).bfloat16()
    return w1, w2, w3


def check_moe_invariance(device, batches, E=8, dim=512, hidden=256, top_k=2, mxfp8=False):
    from prime_kernels_flash_moe import ops

    print(f"flash_moe batch invariance: seed {SEED}")
    g = torch.Generator(device=device).manual_seed(SEED)
    w1, w2, w3 = _weights(E, dim, hidden, device, g)
    px = torch.randn(PROBES, dim, device=device, generator=g).bfloat16()
    pids = torch.stack([torch.randperm(E, device=device, generator=g)[:top_k] for _ in range(PROBES)]).int()
    pw = torch.rand(PROBES, top_k, device=device, generator=g)
    alone = [ops.moe(px[i:i + 1], w1, w2, w3, pids[i:i + 1], pw[i:i + 1], deterministic=True, mxfp8=mxfp8)[0]
             for i in range(PROBES)]
    for n in batches:
        k = min(PROBES, n)
        x = torch.randn(n, dim, device=device, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, device=device, generator=g)[:top_k] for _ in range(n)]).int()
        ids[torch.rand(n, top_k, device=device, generator=g) < 0.05] = -1  # some slots not routed
        tw = torch.rand(n, top_k, device=device, generator=g)
        pos = torch.randperm(n, device=device, generator=g)[:k]
        x[pos], ids[pos], tw[pos] = px[:k], pids[:k], pw[:k]
        out = ops.moe(x, w1, w2, w3, ids, tw, deterministic=True, mxfp8=mxfp8)
        for i in range(k):
            diff = (out[pos[i]] != alone[i]).sum().item()
            assert diff == 0, f"{device} mxfp8={mxfp8}: probe {i} in a batch of {n}: {diff} of {dim} outputs differ"


def test_cpu_moe_deterministic_is_batch_invariant():
    check_moe_invariance("cpu", (1, 7, 64, 1500))


def test_cpu_moe_mxfp8_deterministic_is_batch_invariant():
    check_moe_invariance("cpu", (1, 7, 64), mxfp8=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mxfp8", [False, True])
def test_gpu_moe_deterministic_is_batch_invariant(mxfp8):
    """mxfp8: moe() quantizes x and the weights with one exponent per 128 of K, so every routed row of a stage carries
    shared exponents and the kernels' tile-wide fast-path flag depends on the weights alone. Before padding rows were
    zero-filled in the down GEMM (sm90_common.cuh routing_row) it also read unwritten intermediate rows: 28 of a
    probe's 1024 outputs differed between a batch of 1 and one of 64 (H200, 2026-12-01)."""
    check_moe_invariance("cuda", (1, 7, 64, 1500, 16384), E=16, dim=1024, hidden=512, top_k=4, mxfp8=mxfp8)
