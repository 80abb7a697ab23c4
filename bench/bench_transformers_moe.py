"""GPU benchmark (never a test): one Qwen3-30B-A3B-shaped MoE layer (transformers' Qwen3MoeSparseMoeBlock: its own
router, then the experts) forward and forward+backward through transformers, with experts implementation
"flash_moe" (prime_kernels_flash_moe.integrations) against every experts implementation transformers ships that runs
here, the bf16 matmul ceiling measured in the same run.

    python bench/bench_transformers_moe.py [--json PATH] [--tokens 4096,16384]

Timing: triton.testing.do_bench median (common.py), every implementation timed in turns, the order reversed each
round (common.interleaved). The peer is transformers' fastest implementation that ran, per
row ("grouped_mm", its default, "batched_mm", "eager", and "deepgemm" / "sonicmoe" when their hub kernels load;
each that cannot run says why). batched_mm copies every slot's expert weights, so it is not run where that copy
exceeds free memory. Floors: FLOPs / the same-run 8192^3 bf16 matmul rate; forward FLOPs = router 2 T H E + experts
2 T k H 2I + 2 T k I H; forward+backward floor = 3x that (what any implementation must compute; flash_moe also
recomputes gate/up in its backward). Routing: the block's router on random tokens (random router weights).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from common import free, interleaved, matmul_ceiling, peak_extra, run_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # deepgemm / sonicmoe fetch hub kernels: fail fast on an offline host

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
PEERS = ["grouped_mm", "batched_mm", "eager", "deepgemm", "sonicmoe"]


def make_block():
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K, norm_topk_prob=True)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, HIDDEN**-0.5)
        block.experts.down_proj.normal_(0, INTER**-0.5)
        block.gate.weight.normal_(0, HIDDEN**-0.5)
    return config, block.to("cuda", torch.bfloat16)


def batched_mm_bytes(tokens):
    """Bytes of the per-slot weight copies batched_mm makes (gate_up and down, bf16)."""
    return tokens * TOP_K * 3 * INTER * HIDDEN * 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", default="4096,16384", help="comma-separated token counts (batch 1 x T)")
    args = parser.parse_args()
    try:
        import transformers
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as exc:
        sys.exit(f"bench_transformers_moe needs transformers 5.x (its experts registry): {exc}")
    from prime_kernels_flash_moe.integrations import register_transformers

    name = register_transformers(strict=True)  # a fallback would time grouped_mm under flash_moe's name
    ceiling = matmul_ceiling()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; bf16 matmul ceiling 8192^3: "
          f"{ceiling / 1e12:.0f} TFLOP/s")
    config, block = make_block()
    params = list(block.parameters())
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        fwd_flops = 2 * T * HIDDEN * EXPERTS + 2 * T * TOP_K * HIDDEN * 2 * INTER + 2 * T * TOP_K * INTER * HIDDEN
        x = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        row = {"T": T, "hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K,
               "floor_fwd_ms": fwd_flops / ceiling * 1e3, "floor_fwd_bwd_ms": 3 * fwd_flops / ceiling * 1e3,
               "impl": {}, "not_run": {}}
        outputs, peaks = {}, {}

        def clear_grads():
            for t in (x, *params):
                t.grad = None

        for impl in [name, *PEERS]:  # which run here: their outputs and peak memory
            if impl not in ALL_EXPERTS_FUNCTIONS and impl != "eager":
                row["not_run"][impl] = f"transformers {transformers.__version__} does not register {impl}"
                continue
            if impl == "batched_mm" and batched_mm_bytes(T) > torch.cuda.mem_get_info()[0]:
                row["not_run"][impl] = (f"its per-slot weight copies take {batched_mm_bytes(T) / 2**30:.0f} GiB, more "
                                        f"than the {torch.cuda.mem_get_info()[0] / 2**30:.0f} GiB free")
                continue
            config._experts_implementation = impl
            try:
                with torch.no_grad():
                    outputs[impl] = block(x).float()
                block(x).backward(go)  # once before the peak: one-time workspaces are not per-call memory
                clear_grads()
                peaks[impl] = peak_extra(lambda: block(x).backward(go))
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                row["not_run"][impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                outputs.pop(impl, None)
            finally:
                clear_grads()
                free()

        def as_impl(impl, fn):
            def run():
                config._experts_implementation = impl
                return fn()
            return run

        # timed in turns, the order reversed each round (common.interleaved: the H200's clocks fall under sustained
        # load, which a fixed order would charge to whichever runs last)
        with torch.no_grad():
            fwd = interleaved({impl: as_impl(impl, lambda: block(x)) for impl in peaks})
        fwd_bwd = interleaved({impl: as_impl(impl, lambda: block(x).backward(go)) for impl in peaks},
                              grad_to_none=[x, *params])
        clear_grads()
        for impl in peaks:
            row["impl"][impl] = {"fwd_ms": fwd[impl], "fwd_bwd_ms": fwd_bwd[impl],
                                 "fwd_bwd_peak_extra_gib": peaks[impl] / 2**30,
                                 "fwd_tflops": fwd_flops / fwd[impl] / 1e9,
                                 "fwd_bwd_tflops": 3 * fwd_flops / fwd_bwd[impl] / 1e9}
        ours = row["impl"].get(name)
        peers = {k: v for k, v in row["impl"].items() if k != name}
        if ours is None or not peers:
            print(f"T={T}: nothing to compare ({row['not_run']})")
            rows.append(row)
            continue
        fastest = min(peers, key=lambda k: peers[k]["fwd_bwd_ms"])
        fastest_fwd = min(peers, key=lambda k: peers[k]["fwd_ms"])
        row.update(peer=fastest, fwd_bwd_speedup=peers[fastest]["fwd_bwd_ms"] / ours["fwd_bwd_ms"],
                   peer_fwd=fastest_fwd, fwd_speedup=peers[fastest_fwd]["fwd_ms"] / ours["fwd_ms"],
                   output_rel_diff_vs_peer=float((outputs[name] - outputs[fastest]).norm() / outputs[fastest].norm()))
        rows.append(row)
        for impl, r in row["impl"].items():
            print(f"T={T:6d} {impl:11s} fwd {r['fwd_ms']:8.3f} ms ({r['fwd_tflops']:5.0f} TFLOP/s)  fwd+bwd "
                  f"{r['fwd_bwd_ms']:8.3f} ms ({r['fwd_bwd_tflops']:5.0f})  peak extra {r['fwd_bwd_peak_extra_gib']:.2f} GiB")
        for impl, why in row["not_run"].items():
            print(f"T={T:6d} {impl:11s} not run: {why}")
        print(f"T={T:6d} flash_moe vs transformers' fastest: fwd+bwd x{row['fwd_bwd_speedup']:.2f} (vs {fastest}), "
              f"fwd x{row['fwd_speedup']:.2f} (vs {fastest_fwd}); floors fwd {row['floor_fwd_ms']:.3f} ms, fwd+bwd "
              f"{row['floor_fwd_bwd_ms']:.3f} ms; output rel. diff vs {fastest} {row['output_rel_diff_vs_peer']:.2e}")
        del x, go, outputs
        free()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_record(), "ceiling_tflops": ceiling / 1e12, "transformers": transformers.__version__,
                       "ours": name, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
