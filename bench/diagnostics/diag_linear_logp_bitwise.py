"""Whether two builds of linear_logp give the same bits (issue 56: the stable-ABI port against the exact-ABI build):
dumps every output of the forward and backward on seeded inputs that reach each host path (default, batch-invariant,
softcap, bias, grad_weight_fp32, token-chunked grad_weight at N > 262144, output masks), then compares two dumps byte
for byte. On CUDA the ported backward's accumulating GEMMs call cuBLAS itself (csrc/cuda/linear_logp_gemm.h): a
difference there, and not in the forward, points at them.

    PYTHONPATH=/tmp/variants/NAME python3 bench/diagnostics/diag_linear_logp_bitwise.py dump A.pt [--device cuda]
    python3 bench/diagnostics/diag_linear_logp_bitwise.py dump B.pt [--device cuda]
    python3 bench/diagnostics/diag_linear_logp_bitwise.py compare A.pt B.pt
"""
import argparse
import itertools

import torch


def cases(device):
    """(name, inputs, forward kwargs, backward kwargs) over the host paths; shapes keep H and row strides 16-byte
    aligned so that CUDA takes every case."""
    gen = torch.Generator().manual_seed(56)
    shapes = [(7, 64, 300), (1000, 256, 5000)]
    if device != "cpu":
        shapes.append((300000, 64, 1024))  # token-chunked dZ (N x 256 > 2^26); hours on the CPU op
    for (n, h, v), dtype, invariant, softcap, bias, fp32_grad, mask in itertools.product(
            shapes, [torch.bfloat16, torch.float16], [False, True], [None, 30.0], [False, True], [False, True],
            [(True, True, True), (False, True, False)]):
        if n == 300000 and (invariant or dtype == torch.float16 or softcap):
            continue  # the token-chunked path once per bias / grad dtype / mask is enough
        hidden = (torch.randn(n, h, generator=gen) * 0.5).to(dtype).to(device)
        weight = (torch.randn(v, h, generator=gen) * 0.2).to(dtype).to(device)
        labels = torch.randint(0, v, (n,), generator=gen).to(device)
        labels[::11] = -100
        b = (torch.randn(v, generator=gen) * 0.1).to(dtype).to(device) if bias else None
        grads = (torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device))
        name = f"{n}x{h}x{v} {dtype} inv={invariant} softcap={softcap} bias={bias} fp32={fp32_grad} mask={mask}"
        yield name, (hidden, weight, labels, b, grads), dict(batch_invariant=invariant, softcap=softcap), \
            dict(output_mask=list(mask), grad_weight_fp32=fp32_grad)


def dump(path, device):
    import prime_kernels_fused_logp.linear_ops  # noqa: F401  (registers the ops)

    ops = torch.ops.fused_logp
    out = {}
    for name, (hidden, weight, labels, bias, (g_logp, g_ent)), fwd, bwd in cases(device):
        logp, entropy, stats = ops.linear_logp_entropy(hidden, weight, labels, 0.8, None, bias, -100, True,
                                                       fwd["batch_invariant"], fwd["softcap"], 1.0)
        grads = ops.linear_logp_entropy_backward(g_logp, g_ent, hidden, weight, labels, 0.8, None, bias, stats, -100,
                                                 bwd["output_mask"], bwd["grad_weight_fp32"], fwd["batch_invariant"],
                                                 fwd["softcap"], 1.0)
        out[name] = [t.cpu() for t in (logp, entropy, stats, *grads)]
    torch.save(out, path)
    print(f"{len(out)} cases written to {path} ({prime_kernels_fused_logp.__file__})")


def compare(a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    names = ["logp", "entropy", "stats", "grad_hidden", "grad_weight", "grad_bias"]
    differ = 0
    for case in a:
        for label, x, y in zip(names, a[case], b[case]):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                differ += 1
                worst = (x.double() - y.double()).abs().max().item() if x.shape == y.shape and x.numel() else None
                print(f"DIFFERS {case} {label}: max |a - b| = {worst}")
    print(f"{len(a)} cases, {len(a) * len(names)} outputs compared byte for byte, {differ} differ")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["dump", "compare"])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dump(args.paths[0], args.device) if args.mode == "dump" else compare(*args.paths)
