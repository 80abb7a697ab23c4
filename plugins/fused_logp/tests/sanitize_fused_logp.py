"""Small-shape forward + backward of every fused_logp CUDA kernel variant, once, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python plugins/fused_logp/tests/sanitize_fused_logp.py
    compute-sanitizer --tool racecheck python plugins/fused_logp/tests/sanitize_fused_logp.py

Covers fp32/bf16/fp16, int64/int32 labels, odd V (scalar head/tail), rows that are not 16-byte aligned, the
split-vocab path (few rows, large V) and its combine, ignored tokens, an out-of-range label with check_labels=False
(NaN, no read out of bounds), per-token temperature, with and without entropy; batch_invariant=True (V-fixed splits;
unaligned rows through the gather path); the softcap kernels (with logit_scale: int32 labels widened, gather forward,
per-element backward, split-vocab combine). Exits non-zero on a wrong result."""
import torch

from prime_kernels_fused_logp import reference
from prime_kernels_fused_logp.ops import logp_entropy


def run(n, v, dtype, offset=0, label_dtype=torch.int64, per_token=False, entropy=True, invariant=False, tf=None):
    tf = tf or {}
    base = (torch.randn(n, v + offset, device="cuda") * 3).to(dtype)
    x = base[:, offset:].detach().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    y[::3] = -100
    if n > 4:
        y[1] = v + 5  # out of range: NaN for that token, never an out-of-bounds read
    y = y.to(label_dtype)
    t = (torch.rand(n, device="cuda") + 0.5) if per_token else 0.8
    lp, ent = logp_entropy(x, y, t, return_entropy=entropy, check_labels=False, batch_invariant=invariant, **tf)
    loss = lp.nan_to_num().sum() + (ent.nan_to_num().sum() if entropy else 0)
    loss.backward()
    torch.cuda.synchronize()
    ok = y != -100
    ok &= (y >= 0) & (y < v)
    # The float64 reference on the CPU: racecheck reports hazards inside PyTorch's own CUDA reduce kernels.
    cpu = [a.detach().cpu() if torch.is_tensor(a) else a for a in (x, torch.where(ok | (y == -100), y, -100), t)]
    lp64, ent64 = reference.logp_entropy_float64(*cpu, **tf)
    assert torch.allclose(lp[ok].double().cpu(), lp64[ok.cpu()], rtol=1e-4, atol=1e-4), (n, v, dtype)
    if n > 4:
        assert torch.isnan(lp[1])
    return True


def main():
    torch.manual_seed(0)
    cases = [
        (7, 257, torch.float32, 0, torch.int64, False, True),
        (7, 257, torch.bfloat16, 1, torch.int32, True, True),
        (6, 131, torch.float16, 3, torch.int64, False, False),
        (2, 40000, torch.bfloat16, 0, torch.int64, False, True),  # split-vocab + combine
        (3, 33000, torch.float32, 1, torch.int32, True, False),  # split-vocab, misaligned rows
        (5, 1, torch.bfloat16, 0, torch.int64, False, True),
        (0, 64, torch.bfloat16, 0, torch.int64, False, True),
        (7, 70001, torch.bfloat16, 1, torch.int64, True, True, True),  # invariant: 2 splits, gathered rows
        (6, 131, torch.float16, 3, torch.int32, False, False, True),  # invariant: gathered rows, V < a split
        (5, 65536, torch.float32, 0, torch.int64, False, True, True),  # invariant: aligned rows, 2 splits
        (7, 257, torch.bfloat16, 1, torch.int32, True, True, False, dict(softcap=5.0, logit_scale=0.5)),
        (6, 131, torch.float16, 3, torch.int64, False, False, True, dict(softcap=30.0)),
        (2, 40000, torch.float32, 0, torch.int64, False, True, False, dict(softcap=3.0)),  # split-vocab + combine
        (5, 1031, torch.bfloat16, 0, torch.int64, True, True, False, dict(logit_scale=0.0625)),
    ]
    for case in cases:
        if case[0] > 0 and case[1] > 1:
            run(*case)
        else:
            x = torch.randn(case[0], case[1], device="cuda", dtype=case[2], requires_grad=True)
            lp, ent = logp_entropy(x, torch.zeros(case[0], dtype=torch.long, device="cuda"), check_labels=False)
            (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    print("sanitize_fused_logp: ok")


if __name__ == "__main__":
    main()
