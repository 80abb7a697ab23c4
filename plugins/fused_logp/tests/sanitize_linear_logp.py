"""Small-shape forward + backward of every linear_logp CUDA kernel variant, once, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python plugins/fused_logp/tests/sanitize_linear_logp.py
    compute-sanitizer --tool racecheck python plugins/fused_logp/tests/sanitize_linear_logp.py

Covers bf16/fp16, a partial token tile, a partial vocab tile with odd V, a partial K tile (H = 72), bias, per-token
temperature, ignored tokens, an out-of-range label (NaN, no out-of-bounds access), with and without entropy, and the
backward's masks; the softcap kernels (forward epilogue and dZ pass). Exits non-zero on a wrong result (against the CPU implementation)."""
import torch

from prime_kernels_fused_logp.linear_ops import linear_logp_entropy


def run(n, h, v, dtype, bias=False, per_token=False, entropy=True, bad_label=False, tf=None):
    tf = tf or {}
    hid = (torch.randn(n, h) / h**0.25).to(dtype)
    w = (torch.randn(v, h) / h**0.25).to(dtype)
    y = torch.randint(0, v, (n,))
    y[::5] = -100
    b = torch.randn(v) if bias else None
    T = torch.rand(n) + 0.5 if per_token else 0.8
    if bad_label:
        y[1] = v + 3
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in (hid, w, y, T, b)]
    hg, wg = args[0].requires_grad_(), args[1].requires_grad_()
    lp, ent = linear_logp_entropy(hg, wg, args[2], args[3], bias=args[4], return_entropy=entropy, **tf)
    loss = lp.nan_to_num().sum() + (ent.nan_to_num().sum() if entropy else 0)
    loss.backward()
    torch.cuda.synchronize()
    if bad_label:
        assert torch.isnan(lp[1])
        y[1] = -100
    lp_c, _ = linear_logp_entropy(hid, w, y, T, bias=b, **tf)
    ok = torch.ones(n, dtype=torch.bool)
    if bad_label:
        ok[1] = False
    assert torch.allclose(lp.cpu()[ok], lp_c[ok], rtol=1e-3, atol=1e-3), (n, h, v, dtype)


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        run(130, 64, 301, dtype, bias=True, per_token=True)
        run(7, 72, 1000, dtype, entropy=False)
        run(40, 128, 513, dtype, bad_label=True)
    # three token tiles (a CTA pair and an unpaired tile) and more K tiles than ring stages
    run(300, 512, 700, torch.bfloat16, per_token=True)
    for dtype in (torch.bfloat16, torch.float16):
        run(130, 64, 301, dtype, bias=True, per_token=True, tf=dict(softcap=4.0, logit_scale=0.5))
        run(40, 128, 513, dtype, bad_label=True, entropy=False, tf=dict(softcap=30.0))
    print("sanitize_linear_logp: ok")


if __name__ == "__main__":
    main()
