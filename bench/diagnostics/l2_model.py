"""How many bytes flash_moe's bf16 GEMM kernels read from HBM for a CTA order (never a test; no GPU): a model of the
claim order's L2 reuse, to rank tile orders before spending device time on them.

    python bench/diagnostics/l2_model.py [--shape deepseek-v3|qwen3-30b-a3b|mixtral ...] [--l2-mib 30] [--lockstep]
        [--raster-blocks N]

The benchmark's uniform random top-k routing is aligned as moe() aligns it (BLOCK_M blocks, each expert's first block
a multiple of CLUSTER_BLOCKS, -1 blocks between). 132 CTAs take tiles in claim order; each streams its tile's A rows
and weight columns k-slice by k-slice through one LRU cache; a miss is a read from HBM. Staggered (the default): the
CTAs start their first tiles spread over one tile's K loop, as a persistent kernel's CTAs are in its steady state;
--lockstep: all start together (closer to the non-persistent CTA pairs' waves). Epilogue traffic, the atomics and the
gathered rows shared between blocks are left out. Checked against Nsight Compute on an H100 (DeepSeek-V3, session 22):
staggered with 30 MiB, dH 17.2 GB (measured 18.8); lock-step, gate/up 19.2 GB (measured 19.7).
Orders: "groups", raster() of csrc/cuda/sm90_common.cuh; "runs", its raster_by_expert() (the same decode, in Python;
fused_moe_sm90.cu's raster_runs picks it per launch). Measured with runs (session 23): dH 13.5 GB (model 8.9: the
epilogue's g | u reads and dg | du writes, left out here, evict A rows too), dX 18.3 (16.7), gate/up 16.8 (16.7).
"""
from __future__ import annotations

import argparse
import random
import sys
import tomllib
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shapes and timing helpers
from bench_flash_moe import SHAPES as BENCH_SHAPES

MANIFEST = Path(__file__).resolve().parents[2] / "plugins/flash_moe/prime_kernels_flash_moe/kernel.toml"
CONSTANTS = tomllib.loads(MANIFEST.read_text())["flash_moe"]["constants"]
BM, BK, CLUSTER_BLOCKS = CONSTANTS["BLOCK_M"], CONSTANTS["BLOCK_K"], CONSTANTS["CLUSTER_BLOCKS"]
SMS = 132
SHAPES = {name: dims for name, *dims in BENCH_SHAPES[:3]}  # T, E, top_k, dim, hidden
K_SLICE = 4  # BLOCK_K steps per simulated step: coarser steps, same bytes


def expert_ids(T, E, top_k, seed=0):
    """Each block's expert (-1 for the alignment blocks), for uniform random top-k routing."""
    rng = random.Random(seed)
    counts = [0] * E
    for _ in range(T):
        for e in rng.sample(range(E), top_k):
            counts[e] += 1
    ids = []
    for e, n in enumerate(counts):
        ids += [e] * -(-n // BM)
        ids += [-1] * (-len(ids) % CLUSTER_BLOCKS)
    return ids


def raster(t, n_tiles, ids, group_blocks):
    group, r = divmod(t, group_blocks * n_tiles)
    first = group * group_blocks
    in_group = min(group_blocks, len(ids) - first)
    return first + r % in_group, r // in_group


def raster_by_expert(t, n_tiles, ids, group_blocks):
    b = t // n_tiles
    first = b // group_blocks * group_blocks
    last = min(first + group_blocks, len(ids))
    start, end = b, b + 1
    while start > first and ids[start - 1] == ids[b]:
        start -= 1
    while end < last and ids[end] == ids[b]:
        end += 1
    r = t - start * n_tiles
    return start + r % (end - start), r // (end - start)


def hbm_bytes(ids, n_tiles, k_steps, a_bytes, b_bytes, order, group_blocks, l2_bytes, staggered):
    tiles = [tile for tile in (order(t, n_tiles, ids, group_blocks) for t in range(len(ids) * n_tiles)) if ids[tile[0]] >= 0]
    cache, cached, missed = OrderedDict(), 0, 0

    def read(key, size):
        nonlocal cached, missed
        if key in cache:
            cache.move_to_end(key)
            return
        missed += size
        cache[key] = size
        cached += size
        while cached > l2_bytes:
            cached -= cache.popitem(last=False)[1]

    claimed = min(SMS, len(tiles))
    running = [[tiles[i], -(i * k_steps) // SMS if staggered else 0] for i in range(claimed)]  # [tile, k step]
    while running:
        for cta in running:
            (block, n_tile), k = cta
            if k >= 0:
                read(("A", block, k), a_bytes)
                read(("B", ids[block], n_tile, k), b_bytes)
            cta[1] += 1
        for cta in running:
            if cta[1] == k_steps and claimed < len(tiles):
                cta[:] = [tiles[claimed], 0]
                claimed += 1
        running = [cta for cta in running if cta[1] < k_steps]
    return missed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--l2-mib", type=float, default=30.0, help="the LRU's size (H100 and H200: 50 MiB of L2)")
    parser.add_argument("--lockstep", action="store_true", help="all CTAs start together")
    parser.add_argument("--raster-blocks", type=int, default=CONSTANTS["RASTER_BLOCKS"],
                        help="blocks per raster group (default: kernel.toml's RASTER_BLOCKS)")
    args = parser.parse_args()
    step = BK * K_SLICE
    for shape in args.shape:
        T, E, top_k, dim, hidden = SHAPES[shape]
        ids = expert_ids(T, E, top_k)
        kernels = {  # column tiles, K (the A row and weight column bytes per step follow from BM, 256 and step)
            "gate/up": (hidden // 128, dim), "down": (dim // 256, hidden), "dH": (hidden // 256, dim),
            "dX": (dim // 256, 2 * hidden)}
        for name, (n_tiles, K) in kernels.items():
            gb = {label: hbm_bytes(ids, n_tiles, K // step, BM * step * 2, 256 * step * 2, order, args.raster_blocks,
                                   args.l2_mib * 2**20, not args.lockstep) / 1e9
                  for label, order in (("groups", raster), ("runs", raster_by_expert))}
            print(f"{shape:14s} {name:8s} {len(ids)} blocks x {n_tiles} column tiles: HBM reads "
                  + ", ".join(f"{label} {v:.2f} GB" for label, v in gb.items()), flush=True)


if __name__ == "__main__":
    main()
