"""One forward and one backward of the logits op per softcap, for Nsight Compute (never a test, never timed):

    ncu --clock-control none --set full -k regex:fused_logp_ python bench/diagnostics/profile_fused_logp.py [--dtype bfloat16]
    (scripts/gpu_check.sh OUT profile runs it so, PROFILE="bench/diagnostics/profile_fused_logp.py ...")

On randn x 3 logits, as ``bench_fused_logp.py --softcap-ab`` times them, for each of --softcaps in turn (default 30:
every logit within the tanh's series; 10: 3.7 % past it, in every warp; 3: over half) a forward then its backward:
their stall reasons, issue rates and local-memory traffic side by side say what bounds the softcap kernels where
logits leave the series (docs/notes/fused_logp.md, open questions).
"""
from __future__ import annotations

import argparse

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--softcaps", default="30,10,3", help="comma-separated, in launch order")
    parser.add_argument("--shape", default="16384x151936", help="N x V")
    args = parser.parse_args()
    from prime_kernels_fused_logp.ops import logp_entropy

    n, v = (int(d) for d in args.shape.split("x"))
    x = (torch.randn(n, v, device="cuda") * 3).to(getattr(torch, args.dtype)).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    for softcap in (float(s) for s in args.softcaps.split(",")):
        logp, entropy = logp_entropy(x, y, 0.7, check_labels=False, softcap=softcap)
        torch.autograd.grad(logp.sum() + entropy.sum(), x)
        print(f"softcap {softcap}: forward and backward launched", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
