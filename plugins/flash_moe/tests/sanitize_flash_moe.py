"""Small-shape CUDA run of every flash_moe kernel (moe_align count/scan/scatter, gate/up (also keeping g | u), down with
atomics, down per slot (persistent), the backward's dH + SwiGLU-derivative, dX and dW kernels; each family's
activation and bias epilogues; mxfp8: quantize, gate/up with re-quantization, down with atomics / per slot) for compute-sanitizer (memcheck, racecheck, synccheck). Exits 1 on a mismatch with the CPU implementation.

    compute-sanitizer --tool memcheck python plugins/flash_moe/tests/sanitize_flash_moe.py
"""
import sys

import torch

import prime_kernels

ops = prime_kernels.load("flash_moe")
g = torch.Generator().manual_seed(0)
# (tokens, dim, hidden, experts, top_k): a partial column tile in both kernels (hidden 192, dim 320), M = 1, idle experts;
# several blocks per expert (pairs of CTAs) with more K tiles than ring stages in both kernels; ~400 down tiles, so
# each persistent down CTA (one per SM) walks several tiles and reuses its routing-row buffers
for T, dim, hidden, E, k in [(1, 64, 64, 2, 1), (37, 320, 192, 5, 2), (130, 256, 128, 8, 3), (600, 1024, 640, 2, 1),
                             (3072, 2048, 256, 4, 2)]:
    x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w3 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, dim, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    ids = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    align = ops.moe_align(ids, E)
    got_align = ops.moe_align(ids.cuda(), E)
    if not all(torch.equal(a.cpu(), b) for a, b in zip(got_align, align)):
        sys.exit(f"moe_align mismatch for {(T, E, k)}")
    want = ops.moe(x, w1, w2, w3, ids, tw).float()
    cu = [t.cuda() for t in (x, w1, w2, w3, ids, tw)]
    for det in (False, True):
        got = ops.moe(*cu, deterministic=det).cpu().float()
        if not torch.allclose(got, want, rtol=3e-2, atol=3e-2):
            sys.exit(f"moe(deterministic={det}) mismatch for {(T, dim, hidden, E, k)}")
    _, saved = torch.ops.flash_moe.moe_forward(*cu[:2], cu[3], cu[2], *got_align, cu[5], k, ops.BLOCK_M, False, True)
    want_saved = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, k, ops.BLOCK_M).float()
    if not torch.allclose(saved.cpu().float(), want_saved, rtol=2e-2, atol=2e-2):
        sys.exit(f"moe_forward(save_gate_up=True) mismatch for {(T, dim, hidden, E, k)}")
    # the backward's dH kernel (grad_out x W2 with the SwiGLU derivative in its epilogue)
    grad_out = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    want_grads = torch.ops.flash_moe.moe_grad_gate_up(grad_out, w2, want_saved.bfloat16(), *align, tw, k, ops.BLOCK_M)
    got_grads = torch.ops.flash_moe.moe_grad_gate_up(grad_out.cuda(), cu[2], want_saved.bfloat16().cuda(), *got_align,
                                                     cu[5], k, ops.BLOCK_M)
    for a, b in zip(got_grads, want_grads):
        if not torch.allclose(a.cpu().float(), b.float(), rtol=3e-2, atol=3e-2):
            sys.exit(f"moe_grad_gate_up mismatch for {(T, dim, hidden, E, k)}")
    # the backward's dX kernel (persistent, atomics or per slot)
    want_dx = torch.ops.flash_moe.moe_grad_x(*want_grads[0].split(hidden, 1), w1, w3, *align, k, ops.BLOCK_M,
                                             False).float()
    for det in (False, True):  # dg and du read in place from the halves of dg | du
        got_dx = torch.ops.flash_moe.moe_grad_x(*got_grads[0].split(hidden, 1), cu[1], cu[3], *got_align, k,
                                                ops.BLOCK_M, det)
        if not torch.allclose(got_dx.cpu().float(), want_dx, rtol=3e-2, atol=3e-2):
            sys.exit(f"moe_grad_x(deterministic={det}) mismatch for {(T, dim, hidden, E, k)}")
    # the backward's dW kernel (persistent; each expert's compact rows, source rows gathered by token): dW1 and dW2
    key = torch.where(ids.reshape(-1) >= 0, ids.reshape(-1).long(), E)
    order = torch.sort(key, stable=True).indices
    row_token = torch.where(key[order] < E, order // k, -1).to(torch.int32)
    ends = torch.bincount(key, minlength=E + 1)[:E].cumsum(0).to(torch.int32)
    # dW1 from dg read in place (the left half of dg | du), dW2 from p h
    for rows, source, source_major in ((got_grads[0][:, :hidden], x, False), (got_grads[1], grad_out, True)):
        want_w = torch.ops.flash_moe.moe_grad_weight(rows.cpu(), source, row_token, ends, source_major).float()
        got_w = torch.ops.flash_moe.moe_grad_weight(rows, source.cuda(), row_token.cuda(), ends.cuda(), source_major)
        if not torch.allclose(got_w.cpu().float(), want_w, rtol=3e-2, atol=3e-2):
            sys.exit(f"moe_grad_weight(source_major={source_major}) mismatch for {(T, dim, hidden, E, k)}")
    out = torch.empty_like(cu[0])
    ops.fused_moe_bf16(cu[0], torch.cat([cu[1], cu[3]], 1), cu[2], *got_align, cu[5], out, k)
    if not torch.allclose(out.cpu().float(), want, rtol=3e-2, atol=3e-2):
        sys.exit(f"fused_moe_bf16 mismatch for {(T, dim, hidden, E, k)}")
# the families: each activation's gate/up and dH epilogues, the biases, relu2's whole-tile gate/up (partial and several
# column tiles), gate and up interleaved (strided TMA rows; dx as one GEMM over the pairs) and each weight form read in
# place (transposed: N-major gate/up and down B tiles, K-major dH and dX; gpt-oss's transposed pairs); forward and
# every gradient against the CPU. The last shape routes enough slots per expert for the persistent gate/up kernels.
FAMILIES = [("gpt_oss", ops.GPT_OSS_LAYOUT, True), ("gpt_oss", ops.ExpertLayout("stacked"), True),
            ("swiglu", ops.ExpertLayout("interleaved"), False), ("swiglu", ops.ExpertLayout("stacked", True), False),
            ("relu2", ops.ExpertLayout("stacked"), True), ("relu2", ops.ExpertLayout("stacked", transposed=True), False)]
for T, dim, hidden, E, k in [(37, 320, 192, 5, 2), (130, 256, 512, 8, 3), (1100, 512, 256, 2, 1)]:
    for activation, layout, biases in FAMILIES:
        gated = activation != "relu2"
        out_rows = (2 if gated else 1) * hidden
        x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
        w1 = 2 * torch.randn(E, out_rows, dim, generator=g) / dim**0.5  # gpt_oss: some pre-activations past the limit
        w2 = torch.randn(E, dim, hidden, generator=g) / hidden**0.5
        if layout.transposed:
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        b1 = torch.randn(E, out_rows, generator=g) if biases else None
        b2 = torch.randn(E, dim, generator=g) if biases else None
        ids = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
        tw = torch.rand(T, k, generator=g)
        leaves = [None if t is None else t.to(torch.bfloat16).contiguous() for t in (x, w1, w2, b1, b2)]
        go = torch.randn(T, dim, generator=g).to(torch.bfloat16)
        runs = []
        for device, det in (("cpu", False), ("cuda", False), ("cuda", True)):
            ls = [None if t is None else t.detach().to(device).requires_grad_() for t in leaves]
            tws = tw.detach().to(device).requires_grad_()
            out = ops.moe(ls[0], ls[1], ls[2], None, ids.to(device), tws, activation=activation, b1=ls[3], b2=ls[4],
                          layout=layout, deterministic=det)
            grads = torch.autograd.grad(out, [t for t in ls if t is not None] + [tws], go.to(device))
            runs.append([out] + list(grads))
        for det, run in ((False, runs[1]), (True, runs[2])):
            for i, (a, b) in enumerate(zip(run, runs[0])):
                scale = b.float().abs().max().clamp_min(1.0)
                if not torch.allclose(a.cpu().float() / scale, b.float() / scale, rtol=3e-2, atol=3e-2):
                    sys.exit(f"moe({activation}, {layout}, biases={biases}, deterministic={det}) output {i} mismatch "
                             f"for {(T, dim, hidden, E, k)}")
# mxfp8: dim and hidden multiples of 128; M = 1, several column tiles, idle experts, -1 slots
for T, dim, hidden, E, k in [(1, 128, 128, 2, 1), (37, 384, 256, 5, 2), (130, 256, 384, 8, 3)]:
    x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w3 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, dim, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    ids = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    q, sc = ops.quantize_mxfp8(x)
    qc, scc = ops.quantize_mxfp8(x.cuda())
    if not (torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and
            torch.equal(scc.cpu().view(torch.uint8), sc.view(torch.uint8))):
        sys.exit(f"quantize_mxfp8 mismatch for {(T, dim)}")
    for qc, scc in (ops.quantize_mxfp8(x.cuda(), ops.MXFP8_ALIGN), ops.share_exponents_mxfp8(q.cuda(), sc.cuda())):
        qc.view(torch.uint8).sum()  # the shared-exponent kernels run; their bytes are tested in test_flash_moe.py
    want = ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True).float()
    cu = [t.cuda() for t in (x, w1, w2, w3, ids, tw)]
    for det in (False, True):  # one exponent per 128 of K: the kernels' shared-exponent path
        got = ops.moe(*cu, deterministic=det, mxfp8=True).cpu().float()
        if not torch.allclose(got, want, rtol=5e-2, atol=5e-2):
            sys.exit(f"moe(mxfp8=True, deterministic={det}) mismatch for {(T, dim, hidden, E, k)}")
    # per-32 exponents: the kernels' per-32 path
    w = torch.cat([w1, w3], 1)
    operands = [q, sc, *ops.quantize_mxfp8(w), *ops.quantize_mxfp8(w2)]
    operands[3], operands[5] = ops.pack_scales_blocked(operands[3]), ops.pack_scales_blocked(operands[5])
    align = ops.moe_align(ids, E)
    want = ops.fused_moe_mxfp8(*operands, *align, tw, torch.empty_like(x), k).float()
    got = ops.fused_moe_mxfp8(*(t.cuda() for t in operands), *(t.cuda() for t in align), tw.cuda(),
                              torch.empty_like(x).cuda(), k).cpu().float()
    if not torch.allclose(got, want, rtol=5e-2, atol=5e-2):
        sys.exit(f"fused_moe_mxfp8 (per-32 exponents) mismatch for {(T, dim, hidden, E, k)}")
torch.cuda.synchronize()
print("sanitize_flash_moe: ok")
