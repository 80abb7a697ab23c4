"""The MoE peers a user could pick instead of ours, as bench_flash_moe.py --liger hands them our problem (issue 62).

- Liger's Triton fused MoE (liger-kernel 0.8.5, ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``):
  ``apply(x (T, H), gate_up_proj (E, 2I, H), down_proj (E, H, I), top_k_index (T, k) int32, top_k_weights (T, k))``;
  its up-projection kernel reads gate from rows [0, I) of each expert's gate_up_proj and up from rows [I, 2I), i.e. our
  stacked [W1; W3]; down_proj is our w2. Autotuned per (H, I) (and the token gather per (H, k)) on its first call.
- The liger-cute-kernels MoE (``liger_kernel[lck]``: liger-cute-kernels 0.8.5, CUTLASS + NVSHMEM behind TVM FFI,
  expert-parallel; here one rank): ``liger_kernel.ops.cute.ops.moe.moe_fused(X, expert_indices (T, k) int32,
  expert_weights (T, k) bf16, all_B (E, I, H) gate, all_C (E, I, H) up, all_A (E, H, I) down, num_experts, top_k)``,
  after ``liger_cute_kernels.configure(moe=MoEConfig(...))`` on an initialized torch.distributed (capacities fixed per
  configuration: reconfigured per shape after ``nvshmem.pool_clear_all()``).

Each peer's contract, as its sources state it, is written here as a torch formulation (``*_formulation``): the CPU
test (plugins/flash_moe/tests/test_bench_peer_layouts.py) checks that what the adapters (``*_args``) hand a peer
describes our MoE (same weights, transposes, gate/up order), on small float64 tensors against our reference.
``python bench/peer_moe.py --probe-lck`` runs the lck MoE once at a small shape in its own process against its
formulation (exit 0: usable; else the reason on the last line): a native fault there cannot take the benchmark with it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

LIGER_TRITON = "liger-triton"
LIGER_CUTE = "liger-cute"
# The small shape of the lck probe: Qwen3-30B-A3B's expert sizes at few tokens and experts.
PROBE_SHAPE = {"T": 512, "E": 16, "k": 4, "dim": 2048, "hidden": 768}
PROBE_MAX_REL_ERR = 2e-2  # bf16 in, fp32 accumulate: ours measures ~6e-3 against the grouped-mm path


def stack_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[W1; W3] per expert: (E, 2I, H), gate rows first (the layout of ours' stacked form and of Liger's gate_up_proj)."""
    return torch.cat([w1, w3], 1)


def liger_triton_args(x, w13, w2, topk_ids, topk_weights):
    """LigerFusedMoEFunction.apply's arguments for our problem on the stacked gate/up weights ``w13``."""
    return x, w13, w2, topk_ids.to(torch.int32).contiguous(), topk_weights


def lck_args(x, w1, w2, w3, topk_ids, topk_weights):
    """moe_fused's arguments for our problem: gate, up, down as its all_B, all_C, all_A; bf16 routing weights."""
    return (x, topk_ids.to(torch.int32).contiguous(), topk_weights.to(torch.bfloat16), w1, w3, w2, w1.shape[0],
            topk_ids.shape[1])


def _swiglu_experts(x, gate, up, down, topk_ids, topk_weights):
    """sum_k weight[t, k] * down[e] (silu(gate[e] x_t) * up[e] x_t), e = topk_ids[t, k], expert by expert, in the
    inputs' dtype."""
    experts = topk_ids.reshape(-1).long()
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    weights = topk_weights.reshape(-1, 1).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        slots = torch.nonzero(experts == e).squeeze(1)
        xs = x[tokens[slots]]
        y = (F.silu(xs @ gate[e].t()) * (xs @ up[e].t())) @ down[e].t()
        out = out.index_add(0, tokens[slots], weights[slots] * y)
    return out


def liger_triton_formulation(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """Liger's Triton fused MoE as its kernels compute it: gate from rows [0, I) of gate_up_proj[e], up from [I, 2I)."""
    inter = gate_up_proj.shape[1] // 2
    return _swiglu_experts(x, gate_up_proj[:, :inter], gate_up_proj[:, inter:], down_proj, top_k_index,
                           top_k_weights)


def lck_formulation(X, expert_indices, expert_weights, all_B, all_C, all_A, num_experts, top_k):
    """The lck MoE as its frontend documents it: all_B the gate, all_C the up, all_A the down projection."""
    if expert_indices.shape[1] != top_k or all_B.shape[0] != num_experts:
        raise ValueError(f"top_k {top_k} / num_experts {num_experts} do not match expert_indices "
                         f"{tuple(expert_indices.shape)} / all_B {tuple(all_B.shape)}")
    return _swiglu_experts(X, all_B, all_C, all_A, expert_indices, expert_weights)


def liger_triton():
    """LigerFusedMoEFunction.apply, or raises (ImportError and the like) when liger-kernel is not importable."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction.apply


class LckSession:
    """The lck MoE in this process: torch.distributed over this one GPU (NCCL, world size 1: NVSHMEM's bootstrap
    broadcasts through it), NVSHMEM configured by ``configure_for`` for one shape at a time (capacities cannot grow,
    so each shape clears the pools and configures its own)."""

    def __init__(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            store = tempfile.NamedTemporaryFile(prefix="lck_store_", delete=False).name
            dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        from liger_kernel.ops.cute.ops.moe import moe_fused

        self.moe_fused = moe_fused
        self.configured = False

    def configure_for(self, T, E, k, dim):
        from liger_cute_kernels import MoEConfig, configure, nvshmem

        if self.configured:
            nvshmem.pool_clear_all()
        configure(moe=MoEConfig(max_tokens=T, hidden_size=dim, num_experts=E, top_k=k, num_hosts=1, gpus_per_host=1))
        self.configured = True

    def __call__(self, *args):
        return self.moe_fused(*args)


def probe_lck(timeout_s: float = 300) -> str | None:
    """None when the lck MoE ran and agreed with its formulation in a child process, else one sentence why not."""
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-lck"], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"its probe (bench/peer_moe.py --probe-lck) ran past {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    lines = (done.stdout + done.stderr).strip().splitlines() or ["no output"]
    return f"its probe exited {done.returncode}: {lines[-1][:300]}"


def _probe_lck_main() -> int:
    """Our problem at PROBE_SHAPE through the lck MoE, forward and backward, output against lck_formulation."""
    s = PROBE_SHAPE
    T, E, k, dim, hidden = s["T"], s["E"], s["k"], s["dim"], s["hidden"]
    try:
        session = LckSession()
        session.configure_for(T, E, k, dim)
        x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w1, w3 = (torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5 for _ in range(2))
        w2 = torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        ids = torch.rand(T, E, device="cuda").topk(k, -1).indices.to(torch.int32)
        tw = torch.rand(T, k, device="cuda").softmax(-1)
        args = lck_args(x, w1, w2, w3, ids, tw)
        out = session(*args)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        ref = lck_formulation(*[a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
        err = ((out.double() - ref).norm() / ref.norm()).item()
    except Exception as exc:  # noqa: BLE001: the reason is the probe's result
        print(f"lck MoE failed: {type(exc).__name__}: {exc}")
        return 1
    if not err <= PROBE_MAX_REL_ERR:
        print(f"lck MoE output differs from its formulation: relative error {err:.2e} > {PROBE_MAX_REL_ERR}")
        return 1
    print(f"lck MoE ok at {s}: relative error {err:.2e}, x.grad finite {bool(x.grad.isfinite().all())}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe-lck", action="store_true", help="run the lck MoE once at a small shape (exit 0: ok)")
    if parser.parse_args().probe_lck:
        sys.exit(_probe_lck_main())
    parser.print_help()
