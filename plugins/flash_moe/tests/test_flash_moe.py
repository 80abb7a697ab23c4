"""flash_moe: numerics of the forward and of every gradient against a float64 expert-by-expert reference on the same
bf16 inputs (error at most 1.5x the per-expert bf16 PyTorch path's, the path trainers use), moe_align's properties,
the shape contract and argument checks, the conformance kit, torch.compile. CPU tests run everywhere; the
``@pytest.mark.gpu`` tests need CUDA and an sm_90a build. ``-s`` prints the error ratios."""
from __future__ import annotations

import collections
import contextlib
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import prime_kernels
from prime_kernels_core import manifest
from prime_kernels_core.testing import assert_conforms, assert_error_ratio, kernel_module
from prime_kernels_flash_moe.reference import moe_per_expert

KERNEL = "flash_moe"
ops = kernel_module(KERNEL, "prime_kernels_flash_moe.ops")
from prime_kernels_flash_moe import mxfp8  # noqa: E402  (loads _C too: after the skip)
MAX_RATIO = 1.5
cpu = pytest.mark.kernel(KERNEL, device="cpu")
gpu = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]


@pytest.fixture(params=["grouped_mm", "moe_grad_weight"])
def weight_grads(request, monkeypatch):
    """Each path of moe()'s weight gradients, whichever the shape's rule picks (kernel.toml's FUSED_DW_MAX_HIDDEN)."""
    monkeypatch.setitem(ops.CONSTANTS, "FUSED_DW_MAX_HIDDEN", 2**40 if request.param == "moe_grad_weight" else 0)
    return request.param


def make(T, dim, hidden, E, top_k, device="cpu", seed=0, ids=None, num_global=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w3 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, dim, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    if ids is None:
        n = num_global or E
        ids = torch.stack([torch.randperm(n, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, top_k, generator=g).softmax(-1)
    return [t.to(device) for t in (x, w1, w2, w3, ids, tw)]


def check_numerics(x, w1, w2, w3, ids, tw, label, expert_start=0, deterministic=False, grads=True, stacked=False):
    """moe() against float64 per expert, as a ratio to the bf16 per-expert path's error (forward and every gradient).
    stacked: ours takes gate and up as one (E, 2 hidden, dim) w1 (w3 None); its gradient's halves are judged as w1's
    and w3's."""
    hidden = w1.shape[1]
    leaves = [t.detach().clone().requires_grad_(grads) for t in
              ((x, torch.cat((w1, w3), 1), w2) if stacked else (x, w1, w2, w3))]
    tws = tw.detach().clone().requires_grad_(grads)
    ours = ops.moe(*leaves[:3], None if stacked else leaves[3], ids, tws, expert_start=expert_start,
                   deterministic=deterministic)
    base_leaves = [t.detach().clone().requires_grad_(grads) for t in (x, w1, w2, w3)]
    base_tw = tw.detach().clone().requires_grad_(grads)
    base = moe_per_expert(*base_leaves, ids, base_tw, expert_start)
    # float64 on the inputs' device (on the GPU: the Qwen-like case's CPU reference took two minutes)
    ref_leaves = [t.detach().double().requires_grad_(grads) for t in (x, w1, w2, w3)]
    ref_tw = tw.detach().double().requires_grad_(grads)
    ref = moe_per_expert(*ref_leaves, ids, ref_tw, expert_start)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert_error_ratio(f"{label} forward", ours, base, ref, MAX_RATIO)
    if not grads:
        return ours
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    g_ours = torch.autograd.grad(ours, [*leaves, tws], go.to(x.device))
    if stacked:
        g_x, g_w13, g_w2, g_tw = g_ours
        assert g_w13.shape == leaves[1].shape
        g_ours = (g_x, g_w13[:, :hidden], g_w2, g_w13[:, hidden:], g_tw)
    g_base = torch.autograd.grad(base, [*base_leaves, base_tw], go.to(x.device))
    g_ref = torch.autograd.grad(ref, [*ref_leaves, ref_tw], go.double().to(x.device))
    for name, a, b, r, t in zip(("x", "w1", "w2", "w3", "topk_weights"), g_ours, g_base, g_ref,
                                (*base_leaves, base_tw)):
        assert a.dtype == t.dtype and a.shape == t.shape
        if r.norm() == 0:
            assert a.abs().max() == 0, f"{label} grad {name} should be zero"
            continue
        assert_error_ratio(f"{label} grad {name}", a, b, r, MAX_RATIO)
    return ours


def routing_cases(device):
    """(label, problem, expert_start): the issue's cases."""
    cases = [("E4 top2 T512", make(512, 256, 128, 4, 2, device), 0)]
    # experts 1, 2, 5, 6, 7 receive no slot
    ids = torch.tensor([[0, 3], [3, 4], [4, 0]] * 86, dtype=torch.int32)[:256]
    cases.append(("idle experts", make(256, 256, 128, 8, 2, device, seed=1, ids=ids.to(device)), 0))
    # expert 2 receives every token
    ids = make(300, 64, 64, 4, 2, seed=2)[4]
    ids[:, 0] = 2
    ids[:, 1] = torch.where(ids[:, 1] == 2, 0, ids[:, 1])
    cases.append(("one expert takes all", make(300, 256, 128, 4, 2, device, seed=2, ids=ids.to(device)), 0))
    cases.append(("M=1", make(1, 256, 128, 4, 2, device, seed=3), 0))
    # expert parallelism: global 8 experts, this rank holds [4, 8); some slots unrouted (-1)
    x, w1, w2, w3, ids, tw = make(384, 256, 128, 4, 3, device, seed=4, num_global=8)
    ids = ids.clone()
    ids[::5, 0] = -1
    cases.append(("EP experts [4,8) with -1", (x, w1, w2, w3, ids, tw), 4))
    return cases


@cpu
@pytest.mark.parametrize("case", range(5))
def test_cpu_numerics(case, weight_grads):
    label, problem, start = routing_cases("cpu")[case]
    check_numerics(*problem, f"cpu {label} {weight_grads}", expert_start=start)


@cpu
@pytest.mark.parametrize("case", range(5))
def test_cpu_numerics_stacked_gate_up(case, weight_grads):
    label, problem, start = routing_cases("cpu")[case]
    check_numerics(*problem, f"cpu {label} {weight_grads} stacked", expert_start=start, stacked=True)


@cpu
@pytest.mark.parametrize("deterministic,mxfp8", [(False, False), (True, False), (False, True)])
def test_cpu_stacked_gate_up_gives_the_separate_weights_results(deterministic, mxfp8, weight_grads):
    """w1 and w3 stacked into one (E, 2 hidden, dim) w1 (w3 None): the same output and gradients, bitwise, its
    gradient the two weights' gradients stacked (mxfp8: the same quantized [gate; up] either way)."""
    x, w1, w2, w3, ids, tw = make(300, 256, 128, 6, 2, seed=3)
    separate = [t.clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
    stacked = [t.clone().requires_grad_() for t in (x, torch.cat((w1, w3), 1), w2, tw)]
    out = ops.moe(*separate[:4], ids, separate[4], deterministic=deterministic, mxfp8=mxfp8)
    out_stacked = ops.moe(*stacked[:3], None, ids, stacked[3], deterministic=deterministic, mxfp8=mxfp8)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out.dtype)
    g_x, g_w1, g_w2, g_w3, g_tw = torch.autograd.grad(out, separate, grad_out)
    got = torch.autograd.grad(out_stacked, stacked, grad_out)
    for name, a, b in zip(("out", "x", "w1|w3", "w2", "topk_weights"), (out_stacked, *got),
                          (out, g_x, torch.cat((g_w1, g_w3), 1), g_w2, g_tw)):
        assert torch.equal(a, b), name


@cpu
def test_cpu_fused_op_matches_moe_and_overwrites_out():
    x, w1, w2, w3, ids, tw = make(200, 128, 64, 4, 2, seed=5)
    ids[3] = -1  # token 3 unrouted: its row must come back zero
    s, e, n = ops.moe_align(ids, 4)
    out = torch.full_like(x, float("nan"))
    ops.fused_moe_bf16(x, torch.cat([w1, w3], 1), w2, s, e, n, tw, out, 2, block_n=64, warp_n=32, stages=3, bpc=1,
                       cpc=2, split=False)
    torch.testing.assert_close(out, ops.moe(x, w1, w2, w3, ids, tw), rtol=0, atol=0)
    assert (out[3] == 0).all()


def _check_align(ids, E, block_m, bpc=1, expert_start=0, num_local=None, device="cpu", block_align=1):
    s, e, n = ops.moe_align(ids.to(device), E, block_m, bpc, expert_start=expert_start, num_local_experts=num_local,
                            block_align=block_align)
    s, e, n = s.cpu(), e.cpu(), int(n.cpu()[0])
    local_n = num_local if num_local is not None else E - expert_start
    pad, span = block_m * bpc, block_m * block_align
    S = ids.numel()
    assert s.dtype == e.dtype == torch.int32
    assert s.numel() == ops.max_padded(S, local_n, block_m, bpc, block_align) == (
        (S + local_n * (pad - 1) + pad - 1) // pad * pad + local_n * (span - block_m))
    assert e.numel() == s.numel() // block_m and n % span == 0 and n <= s.numel()
    flat = ids.reshape(-1).long()
    local = flat - expert_start
    pos = 0
    for ex in range(local_n):
        want = torch.nonzero((flat >= 0) & (local == ex)).squeeze(1).int()  # stable: ascending slot order
        padded = (want.numel() + pad - 1) // pad * pad
        assert torch.equal(s[pos:pos + want.numel()], want), f"expert {ex}: slots not grouped/stable"
        assert (s[pos + want.numel():pos + padded] == -1).all(), f"expert {ex}: padding is not -1"
        assert (e[pos // block_m:(pos + padded) // block_m] == ex).all()
        spanned = (padded + span - 1) // span * span  # empty blocks up to the next aligned start
        assert (s[pos + padded:pos + spanned] == -1).all()
        assert (e[(pos + padded) // block_m:(pos + spanned) // block_m] == -1).all()
        pos += spanned
    assert pos == n
    assert (s[n:] == -1).all() and (e[n // block_m:] == -1).all()
    return s, e, n


@cpu
def test_moe_align_properties():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (333, 4), generator=g, dtype=torch.int32)
    _check_align(ids, 16, 128)
    _check_align(ids, 16, 16, bpc=3)
    ids[::7, 1] = -1
    _check_align(ids, 16, 64, expert_start=5, num_local=6)  # EP: [5, 11), others and -1 skipped
    _check_align(ids[:1], 16, 128)                           # M = 1
    _check_align(ids[:0], 16, 128)                           # no tokens: no blocks
    big = torch.randint(0, 1024, (4096, 8), generator=g, dtype=torch.int32)
    s, e, n = _check_align(big, 1024, 128)
    assert n <= s.numel()
    # idle experts cost nothing: only the two used experts get blocks
    s, e, n = _check_align(torch.tensor([[3, 900]] * 5, dtype=torch.int32), 1024, 128)
    assert n == 256 and e[0] == 3 and e[1] == 900


@cpu
def test_moe_align_block_align_starts_experts_on_cluster_boundaries():
    g = torch.Generator().manual_seed(1)
    # 1-3 blocks per expert, so odd block counts leave an empty block before the next expert
    ids = torch.randint(0, 6, (300, 2), generator=g, dtype=torch.int32)
    s, e, n = _check_align(ids, 6, 32, block_align=2)
    starts = [b for b in range(n // 32) if e[b] >= 0 and (b == 0 or e[b - 1] != e[b])]
    assert len(starts) == 6 and all(b % 2 == 0 for b in starts)
    assert (e[:n // 32] == -1).any()  # some expert had an odd block count
    _check_align(ids, 6, 16, bpc=3, block_align=4)
    ids[::3, 0] = -1
    _check_align(ids, 6, 32, expert_start=2, num_local=3, block_align=2)
    _check_align(ids[:0], 6, 32, block_align=2)  # no tokens: no blocks, empty ones included
    # the fused op treats the empty blocks as padding: same output as without alignment
    x, w1, w2, w3, ids, tw = make(200, 128, 64, 4, 2, seed=6)
    w = torch.cat([w1, w3], 1)
    outs = []
    for block_align in (1, 2, 3):
        out = torch.full_like(x, float("nan"))
        ops.fused_moe_bf16(x, w, w2, *ops.moe_align(ids, 4, block_align=block_align), tw, out, 2)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)


@cpu
def test_moe_align_rejects():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"topk_ids must be in \[-1, num_experts=4\)"):
        ops.moe_align(torch.full((4, 2), 4, dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="at most 1024 local experts, got num_local_experts="):
        ops.moe_align(ids, 2048)
    with pytest.raises(RuntimeError, match="topk_ids must be 2-D"):
        torch.ops.flash_moe.moe_align(ids.view(-1), 4, 128, 1, 0, -1)
    with pytest.raises(RuntimeError, match="topk_ids must be int32 or int64, got Float"):
        torch.ops.flash_moe.moe_align(ids.float(), 4, 128, 1, 0, -1)


@cpu
def test_int64_routing_ids_are_not_narrowed():
    x, w1, w2, w3, ids, tw = make(64, 128, 128, 4, 2, seed=50)
    long_ids = ids.long()
    for a, b in zip(ops.moe_align(long_ids, 4), ops.moe_align(ids, 4)):
        assert torch.equal(a, b)
    torch.testing.assert_close(ops.moe(x, w1, w2, w3, long_ids, tw), ops.moe(x, w1, w2, w3, ids, tw), rtol=0, atol=0)
    long_ids[5, 1] = 2**32 + 1  # narrowed to int32 it would be expert 1
    for route in (lambda t: ops.moe_align(t, 4), lambda t: ops.moe(x, w1, w2, w3, t, tw),
                  lambda t: ops.moe(x, w1, w2, w3, t, tw, mxfp8=True)):
        with pytest.raises(RuntimeError, match=r"topk_ids must be in \[-1, num_experts=4\) .* got 4294967297"):
            route(long_ids)
        with pytest.raises(RuntimeError, match="topk_ids must be int32 or int64, got Float"):
            route(ids.float() + 0.5)


@cpu
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_moe_align_rejects_bad_padding(device):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="block_m must be positive, got 0"):
        torch.ops.flash_moe.moe_align(ids, 4, 0, 1, 0, -1)
    with pytest.raises(RuntimeError, match="bpc .* must be positive, got -1"):
        torch.ops.flash_moe.moe_align(ids, 4, 128, -1, 0, -1)
    if device == "meta":  # the fake computes sizes in Python integers: only the CPU op can overflow
        return
    with pytest.raises(RuntimeError, match=r"block_m \* bpc \(the pad unit\) must fit in int32, got "
                                           r"block_m=1099511627776, bpc=1073741824"):
        torch.ops.flash_moe.moe_align(ids, 4, 2**40, 2**30, 0, -1)
    # one slot, two experts padded to 2^30 each: 2^31 entries
    with pytest.raises(RuntimeError, match="the padded length .* must fit in int32, got 2147483648"):
        torch.ops.flash_moe.moe_align(ids[:1, :1], 2, 2**30, 1, 0, -1)
    with pytest.raises(RuntimeError, match="must be int32 ids, got expert_start=4294967296, num_local_experts=4"):
        ops.moe_align(ids, 2**33, expert_start=2**32, num_local_experts=4)


@cpu
def test_shape_contract():
    c = manifest.constants("prime_kernels_flash_moe", KERNEL)
    assert ops.BLOCK_M == c["BLOCK_M"] and ops.MXFP8_SCALE_BLOCK == c["MXFP8_SCALE_BLOCK"] == 32
    assert ops.unsupported_shape_reason(2048, 768) is None and ops.unsupported_shape_reason(7168, 2048) is None
    assert ops.unsupported_shape_reason(4096, 14336, split=False) is None
    assert ops.unsupported_shape_reason(2048, 768, mxfp8=True) is None
    assert ops.unsupported_shape_reason(7168, 2048, mxfp8=True) is None
    for dim, hidden in [(100, 128), (256, 96), (0, 64)]:
        reason = ops.unsupported_shape_reason(dim, hidden)
        with pytest.raises(prime_kernels.UnsupportedShapeError, match="flash_moe needs"):
            prime_kernels.check_shape(ops, dim, hidden)
        if dim == 0:
            continue
        x, w1, w2, w3, ids, tw = make(8, dim, hidden, 2, 1)
        with pytest.raises(RuntimeError) as info:  # the op's own check says the same words
            ops.moe(x, w1, w2, w3, ids, tw)
        assert reason in str(info.value)


@cpu
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(x=a["x"].float()), "x must be bfloat16"),
        (lambda a: a.update(w2=a["w2"][:, :, :64]), r"w2 must have shape \(E, dim, hidden\) = \(4, 128, 128\)"),
        (lambda a: a.update(w2=a["w2"][:3]), "w2 must have E=4 experts"),
        (lambda a: a.update(w=a["w"][:, :, :64]), "w's last dimension must be dim=128"),
        (lambda a: a.update(topk_weights=a["topk_weights"].double()), "topk_weights must be float32"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), r"topk_weights must have shape \(M, top_k\)"),
        (lambda a: a.update(block_m=64), "block_m must be BLOCK_M=128"),
        (lambda a: a.update(out=a["out"][:, :64]), r"out must have shape \(M, dim\)"),
        (lambda a: a.update(expert_ids=a["expert_ids"][:-1]), "expert_ids must be a 1-D int32 tensor"),
        (lambda a: a.update(expert_ids=a["expert_ids"] + 9), r"expert_ids must be in \[-1, E=4\)"),
        (lambda a: a.update(sorted_token_ids=a["sorted_token_ids"].masked_fill(a["sorted_token_ids"] == 0, 32)),
         r"sorted_token_ids must be in \[-1, M \* top_k=32\), got 32"),
    ],
)
def test_bad_arguments_name_the_argument(change, message):
    x, w1, w2, w3, ids, tw = make(16, 128, 128, 4, 2)
    s, e, n = ops.moe_align(ids, 4)
    args = dict(x=x, w=torch.cat([w1, w3], 1), w2=w2, sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=n,
                topk_weights=tw, out=torch.empty_like(x), top_k=2)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.fused_moe_bf16(**args)


@cpu
def test_conforms():
    assert_conforms(KERNEL)


@cpu
@pytest.mark.parametrize("deterministic,recompute,mxfp8,stacked", [
    (False, True, False, False), (True, True, False, False), (False, False, False, False), (False, True, True, False),
    (True, True, True, False), (False, False, False, True), (False, True, True, True)])
def test_compile_forward_backward(deterministic, recompute, mxfp8, stacked):
    # mxfp8: hidden a multiple of MXFP8_ALIGN; stacked: gate and up as one w1 (E, 2 hidden, dim), w3 None
    x, w1, w2, w3, ids, tw = make(64, 128, 128, 4, 2, seed=37) if mxfp8 else make(64, 128, 64, 4, 2, seed=6)
    if stacked:
        w1, w3 = torch.cat((w1, w3), 1), None
    leaves = [t.requires_grad_() for t in (x, w1, w2, w3, tw) if t is not None]

    def step(x, w1, w2, w3, ids, tw):
        return ops.moe(x, w1, w2, w3, ids, tw, deterministic=deterministic, recompute_gate_up=recompute, mxfp8=mxfp8)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        out = fn(x, w1, w2, w3, ids, tw)
        results.append([out.detach(), *torch.autograd.grad(out.float().square().sum(), leaves)])
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def check_saved_gate_up_matches_recompute(device, deterministic):
    """recompute_gate_up=False: the same forward and the same gradients, bitwise (the gate/up kernel stores exactly
    what moe_gate_up recomputes); only the inputs that need a gradient trigger the store."""
    x, w1, w2, w3, ids, tw = make(300, 256, 192, 6, 2, device, seed=21)
    ids = ids.clone()
    ids[::7, 1] = -1  # unrouted slots: rows past the routed ones
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(24)).to(x)
    runs = []
    for recompute in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
        out = ops.moe(*leaves[:4], ids, leaves[4], deterministic=deterministic, recompute_gate_up=recompute)
        runs.append([out.detach(), *torch.autograd.grad(out, leaves, grad_out)])
    # deterministic=False on CUDA combines with atomics: the forward may differ in its last bits from call to call
    same_forward = deterministic or device == "cpu"
    for a, b in list(zip(*runs))[0 if same_forward else 1:]:
        assert torch.equal(a, b)
    align = ops.moe_align(ids, 6)
    out, gate_up = torch.ops.flash_moe.moe_forward(x, w1, w3, w2, *align, tw, 2, ops.BLOCK_M, deterministic, True)
    assert torch.equal(gate_up, torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, 2, ops.BLOCK_M))
    _, none = torch.ops.flash_moe.moe_forward(x, w1, w3, w2, *align, tw, 2, ops.BLOCK_M, deterministic)
    assert none.shape == (0, 2 * 192)


@cpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_cpu_saved_gate_up_matches_recompute(deterministic):
    check_saved_gate_up_matches_recompute("cpu", deterministic)


@cpu
@pytest.mark.parametrize("mxfp8", [False, True])
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(x=a["x"].float()), "moe: x must be bfloat16, got torch.float32"),
        (lambda a: a.update(w1=a["w1"].float()), "moe: w1 must be bfloat16, got torch.float32"),
        (lambda a: a.update(w2=a["w2"].half()), "moe: w2 must be bfloat16, got torch.float16"),
        (lambda a: a.update(w3=a["w3"].float()), "moe: w3 must be bfloat16, got torch.float32"),
        (lambda a: a.update(w1=a["w1"][0]), r"moe: w1 must be 3-D \(E, hidden, dim\) with dim = x's last dimension, "
                                            r"got w1 of shape \(256, 128\) for x of shape \(16, 128\)"),
        (lambda a: a.update(w1=a["w1"][:, :, :64]), r"w1 must be 3-D .* got w1 of shape \(4, 256, 64\)"),
        (lambda a: a.update(w3=a["w3"][:3]), r"moe: w3 must have w1's shape \(E, hidden, dim\) = \(4, 256, 128\), "
                                             r"got \(3, 256, 128\)"),
        (lambda a: a.update(w1=a["w1"][:, :255], w3=None),
         r"moe: with w3 None, w1 must be \(E, 2 hidden, dim\) \(gate and up stacked: w3 is None\) with an even second "
         r"dimension, got w1 of shape \(4, 255, 128\)"),
        (lambda a: a.update(w1=a["w1"][:, :, :64], w3=None), r"w1 must be 3-D \(E, 2 hidden, dim\) \(gate and up "
                                                             r"stacked: w3 is None\) with dim = x's last dimension"),
        (lambda a: a.update(w3=a["w3"].double()), "moe: w3 must be bfloat16"),
        (lambda a: a.update(w2=a["w2"].transpose(1, 2)), r"moe: w2 must have shape \(E, dim, hidden\) = "
                                                         r"\(4, 128, 256\) \(hidden = .*\), got \(4, 256, 128\)"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:8], topk_weights=a["topk_weights"][:8]),
         r"moe: topk_ids must have shape \(..., top_k\) with x's leading dimensions, got topk_ids of shape \(8, 2\) "
         r"for x of shape \(16, 128\)"),
        (lambda a: a.update(topk_ids=a["topk_ids"].repeat(2, 1)), r"got topk_ids of shape \(32, 2\) for x of shape"),
        (lambda a: a.update(topk_ids=a["topk_ids"].view(4, 4, 2)), r"got topk_ids of shape \(4, 4, 2\) for x of shape"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:8]), r"moe: topk_weights must have topk_ids' shape "
                                                                 r"\(..., top_k\), got topk_weights of shape \(8, 2\) "
                                                                 r"for topk_ids of shape \(16, 2\)"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), r"got topk_weights of shape \(16, 1\)"),
    ],
)
def test_moe_checks_operands_before_either_path(change, message, mxfp8):
    x, w1, w2, w3, ids, tw = make(16, 128, 256, 4, 2, seed=51)
    args = dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.moe(**args, mxfp8=mxfp8)


class OpCalls(TorchDispatchMode):
    """Counts the ops that run under it by name ("aten::_grouped_mm", "flash_moe::moe_gate_up", ...), and keeps the
    ``deterministic`` argument of each flash_moe op that takes one (the combine order it was asked for)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.deterministic = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        names = [a.name for a in func._schema.arguments]
        if func.namespace == "flash_moe" and "deterministic" in names:
            at = names.index("deterministic")
            self.deterministic[func.name()] = args[at] if at < len(args) else kwargs["deterministic"]
        return func(*args, **(kwargs or {}))


@cpu
@pytest.mark.parametrize("top_k", [2, ops.CONSTANTS["SLOT_COMBINE_MIN_TOP_K"]])
@pytest.mark.parametrize("deterministic", [False, True])
def test_moe_takes_the_fixed_order_combines_where_they_measured_faster(top_k, deterministic):
    """moe(deterministic=False) combines with atomics below kernel.toml's SLOT_COMBINE_MIN_TOP_K and in fixed order
    from there on (forward and dx); deterministic=True always in fixed order."""
    x, w1, w2, w3, ids, tw = make(32, 128, 64, 8, top_k, seed=10)
    x.requires_grad_()
    with OpCalls() as calls:
        ops.moe(x, w1, w2, w3, ids, tw, deterministic=deterministic).sum().backward()
    fixed = deterministic or top_k >= ops.CONSTANTS["SLOT_COMBINE_MIN_TOP_K"]
    assert calls.deterministic == {"flash_moe::moe_forward": fixed, "flash_moe::moe_grad_x": fixed}


GRADIENT_INPUTS = ("x", "w1", "w2", "w3", "topk_weights")


@cpu
@pytest.mark.parametrize("needed, gemms", [(("w2",), 1), (("x",), 0), (("w1",), 1), (("topk_weights",), 0),
                                           (("x", "w2", "topk_weights"), 1), (GRADIENT_INPUTS, 3)])
@pytest.mark.parametrize("recompute", [False, True])
def test_backward_runs_only_what_the_needed_gradients_take(needed, gemms, recompute, weight_grads):
    """One weight-gradient GEMM (moe_grad_weight or a grouped GEMM) each for dW2, dW1, dW3; dx in one moe_grad_x; g | u from the forward (default) or its
    recomputation once, and grad_h with the SwiGLU derivative in one moe_grad_gate_up unless w2's gradient alone is
    needed (then swiglu_backward gives p h). ("x", "w2", "topk_weights"): frozen w1 / w3."""
    x, w1, w2, w3, ids, tw = make(32, 128, 64, 4, 2, seed=8)
    inputs = dict(zip(GRADIENT_INPUTS, (x, w1, w2, w3, tw)))
    for name in needed:
        inputs[name].requires_grad_()
    out = ops.moe(*(inputs[n] for n in GRADIENT_INPUTS[:4]), ids, inputs["topk_weights"], recompute_gate_up=recompute)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    with OpCalls() as calls:
        grads = torch.autograd.grad(out, [inputs[n] for n in needed], grad_out)
    fused = weight_grads == "moe_grad_weight"
    assert calls.counts["flash_moe::moe_grad_weight"] == (gemms if fused else 0)
    assert calls.counts["aten::_grouped_mm"] == (0 if fused else gemms)
    w2_alone = needed == ("w2",)
    assert calls.counts["flash_moe::moe_gate_up"] == (1 if recompute else 0)
    assert calls.counts["flash_moe::moe_grad_gate_up"] == (0 if w2_alone else 1)
    assert calls.counts["flash_moe::swiglu_backward"] == (1 if w2_alone else 0)
    assert calls.counts["flash_moe::moe_grad_x"] == (1 if "x" in needed else 0)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
    every = torch.autograd.grad(ops.moe(*leaves[:4], ids, leaves[4]), leaves, grad_out)
    for name, grad in zip(needed, grads):  # the same gradients as when every input needs one
        assert torch.equal(grad, every[GRADIENT_INPUTS.index(name)]), name


@cpu
@pytest.mark.parametrize("frozen_gate_up", [False, True])
def test_stacked_gate_up_takes_one_weight_gradient_gemm_for_both(frozen_gate_up, weight_grads):
    """w1 and w3 stacked (w3 None): one GEMM over [dg | du] gives the stacked gradient (dW2 one more); none when the
    stacked weight is frozen, whose gradient is then None while the others are the full backward's."""
    x, w1, w2, w3, ids, tw = make(32, 128, 64, 4, 2, seed=8)
    w13 = torch.cat((w1, w3), 1).requires_grad_(not frozen_gate_up)
    leaves = [t.requires_grad_() for t in (x, w2, tw)]
    out = ops.moe(x, w13, w2, None, ids, tw)
    with OpCalls() as calls:
        grads = torch.autograd.grad(out, [*leaves] + ([] if frozen_gate_up else [w13]),
                                    torch.ones_like(out))
    gemms = 1 if frozen_gate_up else 2
    fused = weight_grads == "moe_grad_weight"
    assert calls.counts["flash_moe::moe_grad_weight"] == (gemms if fused else 0)
    assert calls.counts["aten::_grouped_mm"] == (0 if fused else gemms)
    assert calls.counts["flash_moe::moe_grad_x"] == 1
    every = torch.autograd.grad(ops.moe(x, w13.detach().requires_grad_(), w2, None, ids, tw), leaves,
                                torch.ones_like(out))
    for a, b in zip(grads, every):
        assert torch.equal(a, b)


def op_arguments(func, args, kwargs) -> dict:
    """An op call's arguments by name as a dispatch mode sees them, the defaults filled in (the dispatcher drops
    trailing arguments equal to their defaults)."""
    named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    named.update(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs or {})
    return named


@cpu
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode", "no input needs grad"])
def test_forward_stores_gate_up_only_for_a_backward(mode):
    """The default keeps g | u (moe_forward's save flag) only where a backward can use it: with grad mode on and an
    input that requires grad (needs_input_grad stays True under no_grad, so moe() reads the grad mode itself)."""
    x, w1, w2, w3, ids, tw = make(32, 128, 64, 4, 2, seed=12)
    if mode != "no input needs grad":
        w1.requires_grad_()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    saves = []

    class Saves(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() == "flash_moe::moe_forward":
                saves.append(op_arguments(func, args, kwargs)["save_gate_up"])
            return func(*args, **(kwargs or {}))

    with context(), Saves():
        ops.moe(x, w1, w2, w3, ids, tw)
    assert saves == [mode == "grad"]


@cpu
@pytest.mark.parametrize("num_experts", [None, 12])
@pytest.mark.parametrize("path", ["saved g | u", "recompute g | u", "mxfp8"])
def test_moe_gives_the_kernels_the_global_expert_count(num_experts, path):
    """Under expert parallelism the kernels' launch rules (persistent or paired gate/up, the tile order, the fused dW)
    estimate the routed slots per local expert as M * top_k / num_experts: moe() hands every op the global count it
    was given, the local count when none was."""
    x, w1, w2, w3, ids, tw = make(16, 128, 128, 4, 2, seed=14, num_global=12)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
    seen = {}

    class Counts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() in ("flash_moe::moe_forward", "flash_moe::moe_gate_up", "flash_moe::moe_grad_gate_up",
                               "flash_moe::moe_grad_x"):
                seen[func.name()] = op_arguments(func, args, kwargs)["num_experts"]
            return func(*args, **(kwargs or {}))

    with Counts():
        out = ops.moe(*leaves[:4], ids, leaves[4], expert_start=4, num_experts=num_experts,
                      recompute_gate_up=path == "recompute g | u", mxfp8=path == "mxfp8")
        out.float().sum().backward()
    want = {"flash_moe::moe_grad_gate_up", "flash_moe::moe_grad_x"}
    want |= {"saved g | u": {"flash_moe::moe_forward"}, "recompute g | u": {"flash_moe::moe_forward",
                                                                             "flash_moe::moe_gate_up"},
             "mxfp8": {"flash_moe::moe_gate_up"}}[path]
    assert seen == dict.fromkeys(want, w1.shape[0] if num_experts is None else num_experts)


@cpu
@pytest.mark.parametrize("num_experts", [3, 2**31, -2])
def test_ops_refuse_a_global_expert_count_below_the_local_one(num_experts):
    x, w1, w2, w3, ids, tw = make(16, 128, 128, 4, 2, seed=15)
    align = ops.moe_align(ids, 4)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, 2, ops.BLOCK_M)
    dg = torch.randn(32, 128, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    calls = {
        "moe_forward": lambda *a: torch.ops.flash_moe.moe_forward(*a[:4], *a[4:7], a[7], 2, ops.BLOCK_M, False,
                                                                  num_experts=num_experts),
        "moe_gate_up": lambda *a: torch.ops.flash_moe.moe_gate_up(a[0], a[1], a[3], *a[4:7], 2, ops.BLOCK_M,
                                                                  num_experts=num_experts),
        "moe_grad_gate_up": lambda *a: torch.ops.flash_moe.moe_grad_gate_up(a[0], a[2], a[8], *a[4:7], a[7], 2,
                                                                            ops.BLOCK_M, num_experts=num_experts),
        "moe_grad_x": lambda *a: torch.ops.flash_moe.moe_grad_x(a[9], a[9], a[1], a[3], *a[4:7], 2, ops.BLOCK_M,
                                                                False, num_experts=num_experts),
    }
    for name, call in calls.items():
        for device in ("cpu", "meta"):  # the C++ check and its Python twin (the fake) say the same
            operands = [t.to(device) for t in (x, w1, w2, w3, *align, tw, gate_up, dg)]
            with pytest.raises(RuntimeError, match=rf"{name}: num_experts \(the global expert count\) must be -1 or "
                                                   rf"in \[E, 2\^31 - 1\] \(E=4 local experts\), got {num_experts}"):
                call(*operands)


@cpu
def test_forward_only_ops_refuse_to_differentiate():
    x, w1, w2, w3, ids, tw = make(16, 128, 128, 4, 2, seed=52)
    align = ops.moe_align(ids, 4)
    x_grad, tw_grad = x.clone().requires_grad_(), tw.clone().requires_grad_()
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, 2, ops.BLOCK_M)
    grad_h = torch.randn(32, 128, generator=torch.Generator().manual_seed(53)).to(torch.bfloat16).requires_grad_()
    calls = {
        "moe_forward": lambda: torch.ops.flash_moe.moe_forward(x_grad, w1, w3, w2, *align, tw, 2, ops.BLOCK_M,
                                                               False)[0],
        "moe_forward_mxfp8": lambda: torch.ops.flash_moe.moe_forward_mxfp8(*mx_operands(x, w1, w2, w3), *align,
                                                                           tw_grad, 2, ops.BLOCK_M, False),
        "moe_gate_up": lambda: torch.ops.flash_moe.moe_gate_up(x_grad, w1, w3, *align, 2, ops.BLOCK_M),
        "swiglu_backward": lambda: torch.ops.flash_moe.swiglu_backward(gate_up, grad_h, tw.reshape(-1),
                                                                       torch.ones(32, dtype=torch.bool))[0],
        "moe_grad_gate_up": lambda: torch.ops.flash_moe.moe_grad_gate_up(x_grad, w2, gate_up, *align, tw, 2,
                                                                         ops.BLOCK_M)[0],
        "quantize_mxfp8": lambda: ops.quantize_mxfp8(x_grad)[0],
    }
    for name, call in calls.items():
        out = call()
        with pytest.raises(RuntimeError, match=f"flash_moe::{name} has no derivative"):
            out.float().sum().backward()


# ---------------------------------------------------------------------------------------------------------------
# the backward's pieces
def gate_up_reference(x, w1, w3, ids, E, expert_start=0):
    """float64 [x_t W1^T | x_t W3^T] of the routed slots in moe_align's order (by local expert, then slot)."""
    top_k = ids.shape[1]
    rows = []
    flat = ids.reshape(-1).long() - expert_start
    for e in range(E):
        for slot in torch.nonzero((ids.reshape(-1) >= 0) & (flat == e)).squeeze(1).tolist():
            xt = x[slot // top_k].double()
            rows.append(torch.cat([w1[e].double() @ xt, w3[e].double() @ xt]))
    return torch.stack(rows) if rows else torch.zeros(0, 2 * w1.shape[1], dtype=torch.float64)


def swiglu_backward_reference(gate_up, grad_h, p, valid):
    """float64 autograd of L = sum_rows p (grad_h . silu(g) u) over the valid rows."""
    hidden = grad_h.shape[1]
    gu = gate_up.double().requires_grad_()
    pd = p.double().requires_grad_()
    h = torch.nn.functional.silu(gu[:, :hidden]) * gu[:, hidden:]
    dots = (grad_h.double() * h).sum(1) * valid
    dgu, dp = torch.autograd.grad((pd * dots).sum(), [gu, pd])
    return dgu[:, :hidden], dgu[:, hidden:], (h * pd.unsqueeze(1) * valid.unsqueeze(1)).detach(), dp


def check_moe_gate_up(device, T=300, dim=256, hidden=192, E=6, top_k=2, expert_start=0, num_global=None):
    x, w1, w2, w3, ids, tw = make(T, dim, hidden, E, top_k, device, seed=12, num_global=num_global)
    ids = ids.clone()
    ids[::7, 0] = -1
    align = ops.moe_align(ids, num_global or E, expert_start=expert_start, num_local_experts=E)
    got = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, top_k, ops.BLOCK_M).cpu()
    want = gate_up_reference(x.cpu(), w1.cpu(), w3.cpu(), ids.cpu(), E, expert_start)
    assert got.shape == (T * top_k, 2 * hidden) and got.dtype == torch.bfloat16
    n = want.shape[0]
    # fp32 accumulation rounded once to bf16: within one bf16 rounding of the float64 value
    torch.testing.assert_close(got[:n].double(), want, rtol=2**-8, atol=1e-4)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))


def check_swiglu_backward(device, rows=333, hidden=192):
    g = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 3).to(torch.bfloat16)
    gate_up[0, :hidden] = -100.0  # sigmoid underflows to 0: finite gradients
    grad_h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    grad_h[-1] = float("nan")  # an invalid row may hold anything
    p = torch.rand(rows, generator=g)
    valid = torch.rand(rows, generator=g) > 0.1
    valid[-1] = False
    got = torch.ops.flash_moe.swiglu_backward(gate_up.to(device), grad_h.to(device), p.to(device), valid.to(device))
    want = swiglu_backward_reference(gate_up, torch.where(valid.unsqueeze(1), grad_h, 0), p, valid)
    for name, a, b, dtype in zip(("grad_gate", "grad_up", "weighted_h", "grad_row_weights"), got, want,
                                 (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)):
        assert a.dtype == dtype, name
        # each element is rounded once (bf16) from fp32 arithmetic; the row sum is fp32
        torch.testing.assert_close(a.cpu().double(), b, rtol=2**-7, atol=1e-3, msg=name)
        assert not a[~valid.to(a.device)].any(), f"{name}: invalid rows must be zero"


def check_moe_grad_gate_up(device, T=300, dim=256, hidden=192, E=6, top_k=2, expert_start=0, num_global=None,
                           idle=False):
    """moe_grad_gate_up against float64: grad_h = grad_out_t W2[e] from the bf16 operands, then swiglu_backward's
    float64 reference on the op's own g | u input. Unrouted slots (-1, other ranks' experts) give zero rows and
    weights; ``idle``: every slot goes to expert 0 or E - 1 (the others receive none)."""
    x, w1, w2, w3, ids, tw = make(T, dim, hidden, E, top_k, device, seed=14, num_global=num_global)
    ids = ids.clone()
    if idle:
        ids = torch.where(ids % 2 == 0, expert_start, expert_start + E - 1).to(ids.dtype)
    ids[::7, 0] = -1
    align = ops.moe_align(ids, num_global or E, expert_start=expert_start, num_local_experts=E)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, top_k, ops.BLOCK_M)
    grad_out = torch.randn(T, dim, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16).to(device)
    got = torch.ops.flash_moe.moe_grad_gate_up(grad_out, w2, gate_up, *align, tw, top_k, ops.BLOCK_M)
    # the routed slots in moe_align's order, as gate_up_reference lists them
    flat = ids.reshape(-1).long().cpu() - expert_start
    slots = [s for e in range(E) for s in torch.nonzero((ids.reshape(-1).cpu() >= 0) & (flat == e)).squeeze(1).tolist()]
    n = len(slots)
    slot_t = torch.tensor(slots, dtype=torch.long)
    experts = flat[slot_t] if n else slot_t
    w2d, god = w2.cpu().double(), grad_out.cpu().double()
    grad_h = torch.stack([god[s // top_k] @ w2d[e] for s, e in zip(slots, experts.tolist())]) if n else \
        torch.zeros(0, hidden, dtype=torch.float64)
    p = tw.cpu().reshape(-1)[slot_t].double()
    want = swiglu_backward_reference(gate_up.cpu()[:n], grad_h, p, torch.ones(n, dtype=torch.bool))
    want_tw = torch.zeros(T * top_k, dtype=torch.float64).index_copy_(0, slot_t, want[3]).view(T, top_k)
    dgu = got[0]
    assert dgu.dtype == torch.bfloat16 and dgu.shape == (T * top_k, 2 * hidden)
    for name, a, b in zip(("grad_gate", "grad_up", "weighted_h"), (*dgu.split(hidden, 1), got[1]), want[:3]):
        assert a.dtype == torch.bfloat16 and a.shape == (T * top_k, hidden), name
        # grad_h in fp32 (never rounded), each element rounded once to bf16
        torch.testing.assert_close(a[:n].cpu().double(), b, rtol=2**-7, atol=1e-3, msg=name)
        assert not a[n:].any(), f"{name}: rows past the routed slots must be zero"
    assert got[2].dtype == torch.float32 and got[2].shape == (T, top_k)
    torch.testing.assert_close(got[2].cpu().double(), want_tw, rtol=2**-12, atol=1e-3)
    return got, (grad_out, w2, gate_up, *align, tw, top_k, ops.BLOCK_M)


def check_moe_grad_x(device, T=300, dim=256, hidden=192, E=6, top_k=2, expert_start=0, num_global=None, idle=False,
                     deterministic=True):
    """moe_grad_x against float64 sums of dg W1[e] + du W3[e] over each token's routed slots, on the op's own bf16
    inputs (the halves of moe_grad_gate_up's dg | du, read in place). fp32 accumulation rounded once; the
    deterministic CUDA path also rounds each slot's row to bf16 before the k-order sum, hence the absolute term
    relative to the largest element."""
    got_gu, args = check_moe_grad_gate_up(device, T, dim, hidden, E, top_k, expert_start, num_global, idle)
    dg, du = got_gu[0].split(hidden, 1)
    grad_out, w2, gate_up, sorted_ids, eids, ntpp, tw = args[:7]
    w1, w3 = make(T, dim, hidden, E, top_k, device, seed=14, num_global=num_global)[1:4:2]
    got = torch.ops.flash_moe.moe_grad_x(dg, du, w1, w3, sorted_ids, eids, ntpp, top_k, ops.BLOCK_M, deterministic)
    assert got.dtype == torch.bfloat16 and got.shape == (T, dim)
    # the compact rows in order: block by block, the routed entries of sorted_token_ids
    s_cpu, e_cpu, n_cpu = sorted_ids.cpu(), eids.cpu(), int(ntpp.cpu()[0])
    want = torch.zeros(T, dim, dtype=torch.float64)
    row = 0
    for b in range(n_cpu // ops.BLOCK_M):
        e = int(e_cpu[b])
        for slot in s_cpu[b * ops.BLOCK_M:(b + 1) * ops.BLOCK_M].tolist():
            if slot < 0 or e < 0:
                continue
            want[slot // top_k] += dg[row].cpu().double() @ w1[e].cpu().double() + \
                du[row].cpu().double() @ w3[e].cpu().double()
            row += 1
    torch.testing.assert_close(got.cpu().double(), want, rtol=2**-7, atol=2**-8 * want.abs().max().item())
    return got, (dg, du, w1, w3, sorted_ids, eids, ntpp, top_k, ops.BLOCK_M, deterministic)


def grad_weight_problem(device, T, N, K, counts, seed, unrouted=True):
    """moe_grad_weight's operands: rows (S, N) in expert order (counts[e] rows for expert e, then rows no expert owns),
    source (T, K), row_token (every 5th row -1 when ``unrouted``), expert_ends."""
    g = torch.Generator().manual_seed(seed)
    S = sum(counts) + 3
    rows = torch.randn(S, N, generator=g).to(torch.bfloat16)
    source = torch.randn(T, K, generator=g).to(torch.bfloat16)
    row_token = torch.randint(0, T, (S,), generator=g, dtype=torch.int32)
    if unrouted:
        row_token[::5] = -1
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (rows, source, row_token, ends)]


def grad_weight_by_expert(rows, source, row_token, ends, source_major, dtype):
    """Per expert: its rows against its gathered source rows (zeros for -1), as one matmul in ``dtype`` (bf16: the
    per-expert PyTorch path; float64: the reference)."""
    out, first = [], 0
    for end in ends.tolist():
        tok = row_token[first:end].long()
        src = torch.where((tok >= 0).unsqueeze(1), source[tok.clamp_min(0)], 0).to(dtype)
        r = rows[first:end].to(dtype)
        out.append(src.t() @ r if source_major else r.t() @ src)
        first = end
    return torch.stack(out)


def check_moe_grad_weight(device, T=300, N=192, K=256, counts=(100, 0, 37, 163), source_major=False, fp32=False,
                          seed=20, unrouted=True):
    """moe_grad_weight within 1.5x the per-expert bf16 path's error against float64 (fp32: the fp32 result against
    float64 directly); an expert without rows gets zeros; the same bits on a second run."""
    args = grad_weight_problem(device, T, N, K, counts, seed, unrouted)
    got = torch.ops.flash_moe.moe_grad_weight(*args, source_major, fp32)
    E = len(counts)
    assert got.dtype == (torch.float32 if fp32 else torch.bfloat16)
    assert got.shape == ((E, K, N) if source_major else (E, N, K))
    want = grad_weight_by_expert(*(a.cpu() for a in args), source_major, torch.float64)
    if fp32:  # one fp32 sum per element: relative to the largest term's scale
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        base = grad_weight_by_expert(*args, source_major, torch.bfloat16)
        assert_error_ratio(f"moe_grad_weight {tuple(counts)} source_major={source_major}", got, base,
                           want.to(device), MAX_RATIO)
    for e in range(E):
        if counts[e] == 0:
            assert not got[e].any(), f"expert {e} has no rows: its gradient must be zero"
    assert torch.equal(got, torch.ops.flash_moe.moe_grad_weight(*args, source_major, fp32))
    return got, args


@cpu
@pytest.mark.parametrize("source_major", [False, True])
@pytest.mark.parametrize("fp32", [False, True])
def test_cpu_moe_grad_weight_matches_reference(source_major, fp32):
    check_moe_grad_weight("cpu", source_major=source_major, fp32=fp32)
    check_moe_grad_weight("cpu", T=1, counts=(0, 1), source_major=source_major, fp32=fp32, unrouted=False)  # M = 1
    check_moe_grad_weight("cpu", counts=(0, 300, 0), source_major=source_major, fp32=fp32, unrouted=False)


@cpu
def test_cpu_moe_grad_weight_rejects_bad_routing_values():
    rows, source, row_token, ends = grad_weight_problem("cpu", 50, 64, 64, (20, 30), seed=21)
    with pytest.raises(RuntimeError, match=r"expert_ends must be non-decreasing within \[0, S=53\], got "
                                           r"expert_ends\[1\]=10 after 20"):
        torch.ops.flash_moe.moe_grad_weight(rows, source, row_token, torch.tensor([20, 10], dtype=torch.int32), False)
    bad = row_token.clone()
    bad[7] = 50
    with pytest.raises(RuntimeError, match=r"row_token must hold source rows in \[0, T=50\) or -1 .*got 50"):
        torch.ops.flash_moe.moe_grad_weight(rows, source, bad, ends, False)


@cpu
def test_cpu_moe_grad_x_matches_reference():
    check_moe_grad_x("cpu")
    check_moe_grad_x("cpu", T=1, E=2)
    check_moe_grad_x("cpu", E=4, top_k=3, expert_start=4, num_global=8)
    check_moe_grad_x("cpu", idle=True)


@cpu
def test_cpu_moe_grad_gate_up_matches_reference():
    check_moe_grad_gate_up("cpu")
    check_moe_grad_gate_up("cpu", T=1, E=2)
    check_moe_grad_gate_up("cpu", E=4, top_k=3, expert_start=4, num_global=8)
    check_moe_grad_gate_up("cpu", idle=True)


@cpu
def test_cpu_moe_gate_up_matches_reference():
    check_moe_gate_up("cpu")
    check_moe_gate_up("cpu", E=4, top_k=3, expert_start=4, num_global=8)


@cpu
def test_cpu_swiglu_backward_matches_autograd():
    check_swiglu_backward("cpu")


def test_backward_pieces_reject_bad_arguments():
    gu, gh = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 4, dtype=torch.bfloat16)
    p, ok = torch.zeros(4), torch.ones(4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"grad_h must be bfloat16 of shape \(S, hidden\) = \(4, 4\)"):
        torch.ops.flash_moe.swiglu_backward(gu, gh[:, :3], p, ok)
    with pytest.raises(RuntimeError, match="valid must be bool"):
        torch.ops.flash_moe.swiglu_backward(gu, gh, p, ok.int())
    x, w1, w2, w3, ids, tw = make(8, 64, 64, 2, 1)
    align = ops.moe_align(ids, 2)
    with pytest.raises(RuntimeError, match="moe_gate_up: the gate and up weights must have one shape"):
        torch.ops.flash_moe.moe_gate_up(x, w1, w3[:, :32], *align, 1, ops.BLOCK_M)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, 1, ops.BLOCK_M)
    good = (x, w2, gate_up, *align, tw, 1, ops.BLOCK_M)
    for index, value, message in [
        (0, x.float(), "moe_grad_gate_up: grad_out must be bfloat16, got Float"),
        (0, x[:, :32], r"grad_out must be 2-D \(M, dim\) with dim = w2's second dimension 64"),
        (1, w2[0], r"w2 must be 3-D \(E, dim, hidden\)"),
        (2, gate_up[:, :64], r"gate_up must be bfloat16 of shape \(M \* top_k, 2 \* hidden\) = \(8, 128\)"),
        (6, tw.double(), "topk_weights must be float32"),
    ]:
        args = list(good)
        args[index] = value
        for device in ("cpu", "meta"):  # the C++ checks and their Python twins (the fake) say the same
            moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(RuntimeError, match=message):
                torch.ops.flash_moe.moe_grad_gate_up(*moved)


# ---------------------------------------------------------------------------------------------------------------
# GPU
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("stacked", [False, True])
def test_cuda_graph_replays_forward_and_backward(stacked):
    """moe()'s forward and backward captured in one CUDA graph (a small batch's step is host-bound: session 20 measured
    ~2 ms of host time per forward+backward at 1024 tokens): no host sync and no allocation outside the graph's pool,
    so replays on new inputs copied into the captured tensors give what eager calls give, bitwise (deterministic)."""
    T, dim, hidden, E, top_k = 256, 256, 192, 8, 2
    x, w1, w2, w3, ids, tw = make(T, dim, hidden, E, top_k, device="cuda", seed=61)
    w13 = torch.cat((w1, w3), 1)
    leaves = [t.clone().requires_grad_() for t in ((x, w13, w2, tw) if stacked else (x, w1, w2, w3, tw))]
    static_ids, static_go = ids.clone(), torch.randn_like(x)

    def step(tensors, topk_ids, go):
        weights = (tensors[1], tensors[2], None) if stacked else tuple(tensors[1:4])
        out = ops.moe(tensors[0], *weights, topk_ids, tensors[-1], deterministic=True)
        out.backward(go)
        return out.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: first-call set-up (kernel attributes, caches)
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step(leaves, static_ids, static_go)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(leaves, static_ids, static_go)
    for seed in (62, 63):
        fresh = make(T, dim, hidden, E, top_k, device="cuda", seed=seed)
        values = (fresh[0], torch.cat((fresh[1], fresh[3]), 1), fresh[2], fresh[5]) if stacked else \
            (fresh[0], fresh[1], fresh[2], fresh[3], fresh[5])
        with torch.no_grad():
            for t, v in zip(leaves, values):
                t.copy_(v)
            static_ids.copy_(fresh[4])
            static_go.copy_(torch.randn(T, dim, generator=torch.Generator().manual_seed(seed)).to(x.dtype))
        graph.replay()
        eager = [v.clone().requires_grad_() for v in values]
        assert torch.equal(static_out, step(eager, static_ids, static_go)), "the output after a replay differs"
        for name, got, want in zip(("x", "w1", "w2", "w3", "topk_weights") if not stacked else
                                   ("x", "w13", "w2", "topk_weights"), leaves, eager):
            assert torch.equal(got.grad, want.grad), f"{name}'s gradient after a replay differs from an eager call"


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("case", range(5))
def test_cuda_numerics(case, weight_grads):
    label, problem, start = routing_cases("cuda")[case]
    check_numerics(*problem, f"cuda {label} {weight_grads}", expert_start=start)
    check_numerics(*problem, f"cuda {label} {weight_grads} deterministic", expert_start=start, deterministic=True)
    check_numerics(*problem, f"cuda {label} {weight_grads} stacked", expert_start=start, stacked=True)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("shape", [(256, 2048, 768, 16, 8), (1000, 2048, 768, 128, 8), (77, 512, 320, 8, 2),
                                   # 1024 slots per expert: the GEMMs in raster()'s order (fused_moe_sm90.cu's
                                   # raster_runs), the other shapes in runs of one expert
                                   (2048, 512, 384, 4, 2)])
def test_cuda_numerics_qwen_like(shape, weight_grads):
    T, dim, hidden, E, top_k = shape
    check_numerics(*make(T, dim, hidden, E, top_k, "cuda", seed=9), f"cuda {shape} {weight_grads}")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_align_matches_cpu():
    g = torch.Generator().manual_seed(1)
    for T, E, k, start, local in [(1, 8, 2, 0, None), (4096, 128, 8, 0, None), (3000, 1024, 8, 0, None),
                                  (777, 64, 4, 16, 16), (0, 4, 2, 0, None)]:
        ids = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
        for block_align in (1, ops.CONSTANTS["CLUSTER_BLOCKS"], 3):
            kw = dict(expert_start=start, num_local_experts=local, block_align=block_align)
            for a, b in zip(ops.moe_align(ids.cuda(), E, 128, 1, **kw), ops.moe_align(ids, E, 128, 1, **kw)):
                assert torch.equal(a.cpu(), b)
        _check_align(ids, E, 128, 2, expert_start=start, num_local=local, device="cuda")
        _check_align(ids, E, 128, 1, expert_start=start, num_local=local, device="cuda", block_align=2)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_align_skips_out_of_range_int64_ids():
    ids = torch.randint(-1, 8, (500, 4), generator=torch.Generator().manual_seed(2))
    bad, skipped = ids.clone(), ids.clone()
    bad[::3, 0], bad[1::3, 1], bad[2::3, 2] = 2**32 + 1, -2**40, 8  # past int32, below -1, past num_experts
    skipped[::3, 0], skipped[1::3, 1], skipped[2::3, 2] = -1, -1, -1
    for a, b in zip(ops.moe_align(bad.cuda(), 8), ops.moe_align(skipped.int(), 8)):
        assert torch.equal(a.cpu(), b)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_fused_op_matches_cpu():
    x, w1, w2, w3, ids, tw = make(500, 256, 192, 6, 2, seed=10)
    s, e, n = ops.moe_align(ids, 6)
    w = torch.cat([w1, w3], 1)
    want = ops.fused_moe_bf16(x, w, w2, s, e, n, tw, torch.empty_like(x), 2)
    out = torch.full_like(x, float("nan")).cuda()
    got = ops.fused_moe_bf16(x.cuda(), w.cuda(), w2.cuda(), s.cuda(), e.cuda(), n.cuda(), tw.cuda(), out, 2)
    base = moe_per_expert(x, w1, w2, w3, ids, tw)
    ref = moe_per_expert(x.double(), w1.double(), w2.double(), w3.double(), ids, tw.double())
    assert_error_ratio("cuda fused_moe_bf16", got, base, ref, MAX_RATIO)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_out_of_range_indices_are_skipped_like_padding():
    """The CPU ops raise on these values; the CUDA kernels skip them without a host sync."""
    x, w1, w2, w3, ids, tw = make(300, 256, 256, 6, 2, "cuda", seed=44)
    s, e, n = ops.moe_align(ids, 6)
    picked = torch.nonzero(s >= 0).squeeze(1)[::7]
    bad_s, skipped_s = s.clone(), s.clone()
    bad_s[picked[0::3]], bad_s[picked[1::3]], bad_s[picked[2::3]] = 300 * 2, 2**31 - 1, -5
    skipped_s[picked] = -1
    bad_e, skipped_e = e.clone(), e.clone()
    bad_e[1], skipped_e[1] = 6, -1
    w, mx = torch.cat([w1, w3], 1), mx_operands(x, w1, w2, w3)
    go, gate_up = torch.randn_like(x), torch.randn(300 * 2, 2 * 256, device="cuda", dtype=torch.bfloat16)
    dg, du = torch.randn(2, 300 * 2, 256, device="cuda", dtype=torch.bfloat16)
    # top_k = 2: the atomic combine adds two terms to zero per element, which is order-independent, so exact
    runs = {
        "fused_moe_bf16": lambda s, e: ops.fused_moe_bf16(x, w, w2, s, e, n, tw, torch.empty_like(x), 2),
        "fused_moe_mxfp8": lambda s, e: ops.fused_moe_mxfp8(*mx, s, e, n, tw, torch.empty_like(x), 2),
        "moe_forward deterministic": lambda s, e: torch.ops.flash_moe.moe_forward(x, w1, w3, w2, s, e, n, tw, 2,
                                                                                  ops.BLOCK_M, True, True),
        "moe_gate_up": lambda s, e: torch.ops.flash_moe.moe_gate_up(x, w1, w3, s, e, n, 2, ops.BLOCK_M),
        # a skipped block's slots get no compact row: every output row is written or zeroed, none left uninitialized
        "moe_grad_gate_up": lambda s, e: torch.ops.flash_moe.moe_grad_gate_up(go, w2, gate_up, s, e, n, tw, 2,
                                                                              ops.BLOCK_M),
        "moe_grad_x": lambda s, e: torch.ops.flash_moe.moe_grad_x(dg, du, w1, w3, s, e, n, 2, ops.BLOCK_M, True),
    }
    for name, run in runs.items():
        got, want = run(bad_s, bad_e), run(skipped_s, skipped_e)
        for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_backward_pieces_match_reference():
    check_moe_gate_up("cuda")
    check_moe_gate_up("cuda", T=1000, dim=2048, hidden=768, E=16, top_k=8)
    check_moe_gate_up("cuda", E=4, top_k=3, expert_start=4, num_global=8)
    check_swiglu_backward("cuda")
    check_swiglu_backward("cuda", rows=70, hidden=14336)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("case", [dict(), dict(T=1, E=2), dict(E=4, top_k=3, expert_start=4, num_global=8),
                                  dict(idle=True), dict(T=77, dim=512, hidden=320, E=8), dict(T=1000, dim=2048,
                                  hidden=768, E=16, top_k=8), dict(T=600, dim=1024, hidden=640, E=2, top_k=1)])
def test_cuda_moe_grad_gate_up_matches_reference(case):
    """The dH kernel: a partial column tile (hidden 192, 320, 640), M = 1, EP, idle experts, several blocks per
    expert (CTA pairs) and more K tiles than ring stages; the same bits on a second run and close to the CPU op."""
    got, args = check_moe_grad_gate_up("cuda", **case)
    again = torch.ops.flash_moe.moe_grad_gate_up(*args)
    for a, b in zip(got, again):
        assert torch.equal(a, b)
    want = torch.ops.flash_moe.moe_grad_gate_up(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("case", [dict(), dict(T=1, E=2), dict(E=4, top_k=3, expert_start=4, num_global=8),
                                  dict(idle=True), dict(T=77, dim=512, hidden=320, E=8), dict(T=1000, dim=2048,
                                  hidden=768, E=16, top_k=8), dict(T=600, dim=1024, hidden=640, E=2, top_k=1)])
def test_cuda_moe_grad_x_matches_reference(case):
    """The dX kernel (persistent; dim 256 .. 2048 in 256-column tiles, K = 2 hidden over dg then du), both sums: the
    deterministic one the same bits on a second run, the atomic one close to it."""
    got, args = check_moe_grad_x("cuda", **case)
    assert torch.equal(got, torch.ops.flash_moe.moe_grad_x(*args))
    # dg and du read in place (the halves of dg | du) or from contiguous copies: the same bits
    assert torch.equal(got, torch.ops.flash_moe.moe_grad_x(args[0].contiguous(), args[1].contiguous(), *args[2:]))
    atomic, _ = check_moe_grad_x("cuda", deterministic=False, **case)
    torch.testing.assert_close(atomic.float(), got.float(), rtol=2**-6, atol=2**-7 * got.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("source_major", [False, True])
@pytest.mark.parametrize("case", [
    dict(),  # partial K steps (37, 100, 163 rows), an expert without rows, -1 tokens, a partial column tile
    dict(T=1, counts=(0, 1), unrouted=False),  # M = 1
    dict(counts=(0, 300, 0), unrouted=False),  # one expert takes every row
    dict(T=200, N=200, K=136, counts=(64, 128, 1, 65)),  # widths not whole 64-column atoms; whole K steps
    dict(T=2000, N=768, K=2048, counts=(1000, 1100, 900, 1056)),  # several M and N tiles, K steps > ring stages
    dict(T=400, N=512, K=512, counts=tuple(range(0, 400, 13)), fp32=True),  # 31 experts, fp32 output
    dict(K=320),  # 3 M tiles, the last partial
    dict(T=100, N=256, K=64, counts=(40, 60), fp32=True),  # 1 M tile
])
def test_cuda_moe_grad_weight_matches_reference(source_major, case):
    """The dW kernel (persistent; TMA for whole K steps of the slot rows, cp.async with zero fill for an expert's
    last partial step, the source rows gathered by cp.async): against float64, the same bits on a second run, close to
    the CPU op."""
    got, args = check_moe_grad_weight("cuda", source_major=source_major, **case)
    fp32 = case.get("fp32", False)
    want = torch.ops.flash_moe.moe_grad_weight(*(a.cpu() for a in args), source_major, fp32)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_moe_grad_weight_reads_no_row_of_the_next_expert():
    """Expert 0's last K step is partial (37 rows): the rows after it (expert 1's) hold inf and NaN, and expert 0's
    gradient must not see them (a TMA box of 64 rows would: 0 x inf = NaN). Also through a strided view of rows."""
    rows, source, row_token, ends = grad_weight_problem("cuda", 300, 192, 256, (37, 100), seed=22, unrouted=False)
    wide = torch.zeros(rows.shape[0], 256, dtype=rows.dtype, device="cuda")
    wide[:, :192] = rows
    wide[37:, :192:2] = float("inf")
    wide[37:, 1:192:2] = float("nan")
    rows = wide[:, :192]  # row stride 256: read in place
    for source_major in (False, True):
        got = torch.ops.flash_moe.moe_grad_weight(rows, source, row_token, ends, source_major)
        want = grad_weight_by_expert(rows.cpu()[:37], source.cpu(), row_token.cpu()[:37], ends.cpu()[:1],
                                     source_major, torch.float64)[0]
        assert torch.isfinite(got[0]).all()
        torch.testing.assert_close(got[0].cpu().double(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_frozen_gate_up_weights_give_the_same_gradients(deterministic):
    """needs_input_grad without w1 / w3 (frozen): x, w2 and topk_weights get the gradients of the full backward."""
    x, w1, w2, w3, ids, tw = make(512, 512, 384, 8, 2, "cuda", seed=16)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16).cuda()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
    every = torch.autograd.grad(ops.moe(*leaves[:4], ids, leaves[4], deterministic=deterministic), leaves, grad_out)
    frozen = [t.detach().clone().requires_grad_(i not in (1, 3)) for i, t in enumerate((x, w1, w2, w3, tw))]
    out = ops.moe(*frozen[:4], ids, frozen[4], deterministic=deterministic)
    some = torch.autograd.grad(out, [frozen[i] for i in (0, 2, 4)], grad_out)
    for a, i in zip(some, (0, 2, 4)):
        assert torch.equal(a, every[i]), GRADIENT_INPUTS[i]


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_saved_gate_up_matches_recompute(deterministic):
    check_saved_gate_up_matches_recompute("cuda", deterministic)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_deterministic_is_bitwise_reproducible():
    x, w1, w2, w3, ids, tw = make(2048, 1024, 512, 32, 8, "cuda", seed=11)
    runs = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
        out = ops.moe(*leaves[:4], ids, leaves[4], deterministic=True)
        runs.append([out, *torch.autograd.grad(out.float().square().sum(), leaves)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# mxfp8. The reference quantizer below is written from the OCP MX definition in float64 torch ops (log2 / ceil of
# amax / 448), independently of the op's bit-level code path (csrc/mxfp8.h).
MX = 32


def ref_quantize(t, block=MX):
    f = t.detach().cpu().double().reshape(*t.shape[:-1], t.shape[-1] // block, block)
    amax = f.abs().amax(-1, keepdim=True)
    bad = ~torch.isfinite(f).all(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / 448.0))
    e = torch.where((amax == 0) | bad, torch.full_like(e, -127.0), e).clamp(-127, 127)
    q = (f / torch.exp2(e)).clamp(-448, 448)
    q = torch.where(bad, torch.zeros_like(q), q).float().to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(bad, torch.full_like(q, 0x7F), q)
    sb = torch.where(bad, torch.full_like(e, 255.0), e + 127).to(torch.uint8)
    return q.reshape(t.shape), sb.squeeze(-1)


def ref_dequantize(q, sb, block=MX):
    v = q.view(torch.float8_e4m3fn).double()
    s = torch.exp2(sb.double() - 127).repeat_interleave(block, -1)
    return v * s


def ref_round(t):
    return ref_dequantize(*ref_quantize(t))


def mx_baseline(x, w1, w2, w3, ids, tw, expert_start=0):
    """The quantize-only path: x, w1, w3 (along dim), w2 (along hidden) and h (along hidden) quantized and
    dequantized, everything else in float64."""
    xd, w1d, w2d, w3d = (ref_round(t) for t in (x, w1, w2, w3))
    T, dim = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long().cpu()
    local = flat - expert_start
    valid = (flat >= 0) & (local >= 0) & (local < w1.shape[0])
    p = tw.detach().cpu().double().reshape(-1)
    out = torch.zeros(T, dim, dtype=torch.float64)
    for e in range(w1.shape[0]):
        slots = torch.nonzero(valid & (local == e)).squeeze(1)
        if slots.numel() == 0:
            continue
        tok = slots // top_k
        xs = xd[tok]
        h = ref_round(torch.nn.functional.silu(xs @ w1d[e].t()) * (xs @ w3d[e].t()))
        out.index_add_(0, tok, (h @ w2d[e].t()) * p[slots].unsqueeze(1))
    return out


def special_blocks():
    """Rows of 32 exercising the scale rule's edges: zero, powers of two around 448, tiny and huge amax."""
    rows = [torch.zeros(MX), torch.full((MX,), 448.0), torch.full((MX,), 449.0), torch.full((MX,), 448.0 * 2**-20),
            torch.full((MX,), 1e-40), torch.full((MX,), 3e38), torch.linspace(-1, 1, MX) * 2**-130,
            torch.linspace(-7, 7, MX), torch.tensor([1.0] * 31 + [-2**15])]
    return torch.stack(rows)


@cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_mxfp8_matches_reference_bitwise(dtype):
    g = torch.Generator().manual_seed(20)
    t = torch.randn(64, 8 * MX, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    if dtype == torch.float32:
        t = torch.cat([t, special_blocks().repeat(1, 8)])
    t = t.to(dtype)
    q, s = ops.quantize_mxfp8(t)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (t.shape[0], 8)
    rq, rs = ref_quantize(t)
    assert torch.equal(q.view(torch.uint8), rq) and torch.equal(s.view(torch.uint8), rs)
    q2, s2 = ops.quantize_mxfp8(t.clone())  # bitwise stable
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    d = ops.dequantize_mxfp8(q, s)
    torch.testing.assert_close(d.double(), ref_dequantize(rq, rs).float().double(), rtol=0, atol=0, equal_nan=True)
    # dequantized values re-quantize to the same values, and the error is within half an e4m3 step of the block scale
    torch.testing.assert_close(ops.dequantize_mxfp8(*ops.quantize_mxfp8(d)), d, rtol=0, atol=0, equal_nan=True)
    finite = t.float().abs().amax(-1) < 1e30
    err = (d - t.float()).abs().view(t.shape[0], 8, MX).amax(-1)
    step = torch.exp2(s.view(torch.uint8).double() - 127).float() * 2**-3 * 2**8  # ulp of 448 * scale
    assert (err[finite] <= step[finite] / 2).all()


@cpu
def test_quantize_mxfp8_special_values():
    t = special_blocks()
    _, s = ops.quantize_mxfp8(t)
    b = s.view(torch.uint8).reshape(-1).tolist()
    assert b[0] == 0            # amax 0: the smallest scale 2^-127
    assert b[1] == 127          # amax 448: scale 1
    assert b[2] == 128          # amax 449: scale 2 (rounded up, never saturates)
    assert b[3] == 127 - 20     # exact powers of two stay exact
    assert b[4] == 0 and b[6] == 0  # amax below 448 * 2^-127: clamped to 2^-127
    nan = torch.tensor([[float("nan")] + [1.0] * 31, [float("inf")] + [1.0] * 31])
    q, s = ops.quantize_mxfp8(nan)
    assert (s.view(torch.uint8) == 255).all() and (q.view(torch.uint8) == 0x7F).all()
    with pytest.raises(RuntimeError, match="multiple of block=32"):
        ops.quantize_mxfp8(torch.ones(2, 48))


def ref_share(q, sb, group=ops.MXFP8_ALIGN // MX):
    """share_exponents_mxfp8 in float64: each group's largest scale, elements re-rounded onto it by torch's RNE cast."""
    q, sb = q.view(torch.uint8), sb.view(torch.uint8)
    blocks = sb.reshape(-1, group).long()
    shared = blocks.amax(-1, keepdim=True)
    d = (shared - blocks).repeat_interleave(MX, -1).reshape(q.shape)
    v = q.view(torch.float8_e4m3fn).double() * torch.exp2(-d.double())
    out = v.float().to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.where(d == 0, q, out)  # NaN elements under a smaller scale stay NaN through the cast
    nan_group = (shared == 255).expand(-1, group).repeat_interleave(MX, -1).reshape(q.shape)
    out = torch.where(nan_group, torch.full_like(out, 0x7F), out)
    return out, shared.expand(-1, group).reshape(sb.shape).to(torch.uint8)


def share_cases():
    """mxfp8 rows of 256 (two groups of 4 blocks) whose scales spread 0 .. 40 binades within a group, with e4m3
    subnormal elements, a NaN-scale block, zero blocks and the largest scale."""
    g = torch.Generator().manual_seed(23)
    t = torch.randn(48, 8 * MX, generator=g)
    t = t * torch.exp2(torch.randint(-3, 4, (48, 8), generator=g).float() * (torch.arange(48) % 6 + 1).view(48, 1)
                       ).repeat_interleave(MX, -1)
    t[5, :MX] *= torch.exp2(-torch.arange(MX) / 2)  # subnormals in one block
    t[6, 40] = float("nan")
    t[7, :3 * MX] = 0
    t[8, 100] = 3e38
    q, s = ops.quantize_mxfp8(t)
    return t, q, s


@cpu
def test_share_exponents_matches_reference_bitwise():
    t, q, s = share_cases()
    sq, ss = ops.share_exponents_mxfp8(q, s)
    assert sq.dtype == torch.float8_e4m3fn and ss.dtype == torch.float8_e8m0fnu and sq.shape == q.shape
    rq, rs = ref_share(q, s)
    assert torch.equal(sq.view(torch.uint8), rq) and torch.equal(ss.view(torch.uint8), rs)
    changed = (sq.view(torch.uint8) != q.view(torch.uint8)).sum().item()
    print(f"share_exponents_mxfp8: {changed} of {q.numel()} elements re-rounded")
    assert changed > 0
    # idempotent, the identity on quantize_mxfp8(exponent_block=128), and within half the shared subnormal step
    assert torch.equal(ops.share_exponents_mxfp8(sq, ss)[0].view(torch.uint8), sq.view(torch.uint8))
    eq, es = ops.quantize_mxfp8(t, exponent_block=ops.MXFP8_ALIGN)
    assert torch.equal(ops.share_exponents_mxfp8(eq, es)[0].view(torch.uint8), eq.view(torch.uint8))
    finite = ss.view(torch.uint8) != 255
    before, after = ops.dequantize_mxfp8(q, s).double(), ops.dequantize_mxfp8(sq, ss).double()
    half_step = torch.exp2(ss.view(torch.uint8).double() - 127 - 10).repeat_interleave(MX, -1)
    ok = finite.repeat_interleave(MX, -1)
    assert ((after - before).abs()[ok] <= half_step[ok]).all()
    assert after[~ok].isnan().all()
    with pytest.raises(RuntimeError, match="share_exponents_mxfp8: data's last dimension must be a multiple of "
                                           "MXFP8_ALIGN=128"):
        ops.share_exponents_mxfp8(q[:, :3 * MX], s[:, :3])
    with pytest.raises(RuntimeError, match=r"share_exponents_mxfp8: scales must have shape \(..., K / 32\) = "):
        ops.share_exponents_mxfp8(q, s[:, :4])


@cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_mxfp8_exponent_block(dtype):
    g = torch.Generator().manual_seed(24)
    t = (torch.randn(32, 8 * MX, generator=g) * torch.exp2(torch.randint(-9, 9, (32, 8), generator=g).float()
                                                             ).repeat_interleave(MX, -1)).to(dtype)
    q, s = ops.quantize_mxfp8(t, exponent_block=ops.MXFP8_ALIGN)
    rq, rs = ref_quantize(t, ops.MXFP8_ALIGN)
    assert torch.equal(q.view(torch.uint8), rq)
    assert torch.equal(s.view(torch.uint8), rs.repeat_interleave(ops.MXFP8_ALIGN // MX, -1)) and s.shape == (32, 8)
    # within e4m3's rounding of the per-32 encoding except below the shared scale's normal range
    d32 = ops.dequantize_mxfp8(*ops.quantize_mxfp8(t)).double()
    err, err32 = (ops.dequantize_mxfp8(q, s).double() - t.double()).norm(), (d32 - t.double()).norm()
    print(f"quantize_mxfp8 {dtype}: error with shared exponents / per 32 = {err / err32:.4f}")
    assert err <= 1.05 * err32
    with pytest.raises(RuntimeError, match="quantize_mxfp8: exponent_block must be a multiple of block=32, got 48"):
        ops.quantize_mxfp8(t, exponent_block=48)


@cpu
def test_pack_scales_blocked_round_trip():
    g = torch.Generator().manual_seed(21)
    s = torch.randint(0, 255, (3, 40, 12), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    p = ops.pack_scales_blocked(s)
    assert p.shape == (3, 3, 40, 4) and p.dtype == torch.float8_e8m0fnu and p.is_contiguous()
    su, pu = s.view(torch.uint8), p.view(torch.uint8)
    for e, kt, n, j in [(0, 0, 0, 0), (2, 1, 39, 3), (1, 2, 17, 1)]:
        assert pu[e, kt, n, j] == su[e, n, 4 * kt + j]
    assert torch.equal(ops.unpack_scales_blocked(p).view(torch.uint8), su)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        ops.pack_scales_blocked(s[:, :, :6])


@cpu
def test_mxfp8_helpers_check_their_arguments():
    t = torch.randn(4, 4 * MX, generator=torch.Generator().manual_seed(22))
    q, s = ops.quantize_mxfp8(t)
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError, match="quantize_mxfp8: block must be positive, got 0"):
            ops.quantize_mxfp8(t.to(device), 0)
    with pytest.raises(RuntimeError, match=r"dequantize_mxfp8: scales must have shape \(..., K / block\) = \(4, 4\) "
                                           r"for data of shape \(4, 128\), got \(1, 4\)"):
        ops.dequantize_mxfp8(q, s[:1])
    with pytest.raises(RuntimeError, match=r"dequantize_mxfp8: block must be positive .* got block=0"):
        ops.dequantize_mxfp8(q, s, block=0)
    with pytest.raises(RuntimeError, match="dequantize_mxfp8: data must be float8_e4m3fn .* got data torch.uint8"):
        ops.dequantize_mxfp8(q.view(torch.uint8), s)
    with pytest.raises(RuntimeError, match="pack_scales_blocked: scales must be float8_e8m0fnu .* got torch.float32"):
        ops.pack_scales_blocked(torch.ones(2, 4, 8))
    with pytest.raises(RuntimeError, match=r"unpack_scales_blocked: packed must be pack_scales_blocked's layout "
                                           r"\(E, K / 128, N, 4\) .* got torch.uint8 of shape \(2, 4, 8\)"):
        ops.unpack_scales_blocked(torch.ones(2, 4, 8, dtype=torch.uint8))


def mx_operands(x, w1, w2, w3, exponent_block=None):
    xq, xs = ops.quantize_mxfp8(x, exponent_block=exponent_block)
    wq, ws = ops.quantize_mxfp8(torch.cat([w1, w3], 1), exponent_block=exponent_block)
    w2q, w2s = ops.quantize_mxfp8(w2, exponent_block=exponent_block)
    return xq, xs, wq, ops.pack_scales_blocked(ws), w2q, ops.pack_scales_blocked(w2s)


def mx_routing_cases(device):
    cases = [("E4 top2 T256", make(256, 256, 128, 4, 2, device, seed=30), 0)]
    ids = torch.tensor([[0, 3], [3, 4], [4, 0]] * 43, dtype=torch.int32)[:128]
    cases.append(("idle experts", make(128, 128, 256, 8, 2, device, seed=31, ids=ids.to(device)), 0))
    cases.append(("M=1", make(1, 256, 128, 4, 2, device, seed=32), 0))
    x, w1, w2, w3, ids, tw = make(192, 128, 128, 4, 3, device, seed=33, num_global=8)
    ids = ids.clone()
    ids[::5, 0] = -1
    cases.append(("EP experts [4,8) with -1", (x, w1, w2, w3, ids, tw), 4))
    return cases


def check_mx_numerics(x, w1, w2, w3, ids, tw, label, expert_start=0, deterministic=False):
    ours = ops.moe(x, w1, w2, w3, ids, tw, expert_start=expert_start, deterministic=deterministic, mxfp8=True)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    base = mx_baseline(x, w1, w2, w3, ids, tw, expert_start)
    ref = moe_per_expert(*(t.detach().double() for t in (x, w1, w2, w3)), ids, tw.double(), expert_start)
    return assert_error_ratio(f"{label} mxfp8 forward", ours, base, ref, MAX_RATIO)


@cpu
@pytest.mark.parametrize("case", range(4))
def test_cpu_mxfp8_numerics(case):
    label, problem, start = mx_routing_cases("cpu")[case]
    check_mx_numerics(*problem, f"cpu {label}", expert_start=start)


@cpu
def test_cpu_mxfp8_fused_op_matches_moe_and_overwrites_out():
    x, w1, w2, w3, ids, tw = make(100, 256, 128, 4, 2, seed=34)
    ids[3] = -1
    s, e, n = ops.moe_align(ids, 4)
    out = torch.full_like(x, float("nan"))
    ops.fused_moe_mxfp8(*mx_operands(x, w1, w2, w3, ops.MXFP8_ALIGN), s, e, n, tw, out, 2)
    torch.testing.assert_close(out, ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True), rtol=0, atol=0)
    assert (out[3] == 0).all()


@cpu
def test_mxfp8_backward_is_the_bf16_closed_form_on_dequantized_operands():
    x, w1, w2, w3, ids, tw = make(64, 128, 128, 4, 2, seed=35)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
    out = ops.moe(*leaves[:4], ids, leaves[4], mxfp8=True)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads = torch.autograd.grad(out, leaves, go)
    # quantized as moe(mxfp8=True) quantizes (one exponent per MXFP8_ALIGN): grad_h stays fp32 in the backward, so
    # the few tiny elements that per-32 exponents round differently would show in d topk_weights
    dq = [ops.dequantize_mxfp8(*ops.quantize_mxfp8(t, exponent_block=ops.MXFP8_ALIGN), dtype=torch.bfloat16)
          for t in (x, w1, w2, w3)]
    dq_leaves = [t.requires_grad_() for t in dq] + [tw.clone().requires_grad_()]
    want = torch.autograd.grad(ops.moe(*dq_leaves[:4], ids, dq_leaves[4]), dq_leaves, go)
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture
def weight_quantizations(monkeypatch):
    """The weight sets moe(mxfp8=True)'s cache quantized (one entry per quantization)."""
    calls = []
    quantize = mxfp8.quantize_weights

    def counted(w1, w2, w3):
        calls.append((w1, w2, w3))
        return quantize(w1, w2, w3)

    monkeypatch.setattr(mxfp8, "quantize_weights", counted)
    return calls


def quantized_weight_bytes(w1, w2, w3):
    """What moe(mxfp8=True) should run on, from the public quantization ops."""
    wq, ws = ops.quantize_mxfp8(torch.cat([w1, w3], 1), exponent_block=ops.MXFP8_ALIGN)
    w2q, w2s = ops.quantize_mxfp8(w2, exponent_block=ops.MXFP8_ALIGN)
    return [t.view(torch.uint8) for t in (wq, ops.pack_scales_blocked(ws), w2q, ops.pack_scales_blocked(w2s))]


@cpu
def test_mxfp8_weight_cache_follows_versions(weight_quantizations):
    x, w1, w2, w3, ids, tw = make(32, 128, 128, 4, 2, seed=36)
    w1 = w1.clone().requires_grad_()
    first = mxfp8.cached_quantized_weights(w1, w2, w3)
    assert mxfp8.cached_quantized_weights(w1, w2, w3) is first          # same version: cached
    out0 = ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True)
    opt = torch.optim.SGD([w1], lr=10.0)
    out0.float().sum().backward()
    opt.step()                                                          # in-place update bumps _version
    second = mxfp8.cached_quantized_weights(w1, w2, w3)
    assert second is not first and not torch.equal(second[0].view(torch.uint8), first[0].view(torch.uint8))
    assert torch.equal(second[0].view(torch.uint8), quantized_weight_bytes(w1.detach(), w2, w3)[0])
    assert not torch.equal(ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True), out0.detach())
    assert len(weight_quantizations) == 2


@cpu
def test_mxfp8_weight_cache_holds_every_layer(weight_quantizations):
    layers = [make(1, 128, 128, 2, 1, seed=60 + i)[1:4] for i in range(40)]  # more than the old FIFO cap of 32
    for _ in range(3):
        for w1, w2, w3 in layers:
            mxfp8.cached_quantized_weights(w1, w2, w3)
    assert len(weight_quantizations) == len(layers)
    # fresh views of one fused gate/up parameter hit too; an in-place update of the parameter re-quantizes
    w1, w2, w3 = layers[0]
    w13 = torch.nn.Parameter(torch.cat([w1, w3], 1))
    views = [mxfp8.cached_quantized_weights(w13[:, :128], w2, w13[:, 128:]) for _ in range(3)]
    assert all(v is views[0] for v in views) and len(weight_quantizations) == len(layers) + 1
    with torch.no_grad():
        w13.mul_(-2.0)
    updated = mxfp8.cached_quantized_weights(w13[:, :128], w2, w13[:, 128:])
    assert len(weight_quantizations) == len(layers) + 2
    for got, want in zip(updated, quantized_weight_bytes(w13[:, :128].detach(), w2, w13[:, 128:].detach())):
        assert torch.equal(got.view(torch.uint8), want)


@cpu
@pytest.mark.parametrize("freed", range(3))
def test_mxfp8_weight_cache_entry_dies_with_its_weights(freed):
    weights = [t.clone() for t in make(1, 128, 128, 2, 1, seed=70 + freed)[1:4]]
    cached = [weakref.ref(t) for t in mxfp8.cached_quantized_weights(*weights)]
    gc.collect()
    assert all(r() is not None for r in cached)  # held by the cache
    del weights[freed]
    gc.collect()
    assert all(r() is None for r in cached)


@cpu
def test_mxfp8_weight_cache_clear_after_writes_that_keep_the_version(weight_quantizations):
    w1, w2, w3 = (torch.nn.Parameter(t) for t in make(1, 128, 128, 2, 1, seed=80)[1:4])
    first = mxfp8.cached_quantized_weights(w1, w2, w3)
    w1.data.mul_(-2.0)  # .data has its own version counter: w1._version stays, so the cache cannot see this write
    assert mxfp8.cached_quantized_weights(w1, w2, w3) is first
    ops.clear_mxfp8_weight_cache()
    fresh = mxfp8.cached_quantized_weights(w1, w2, w3)
    assert len(weight_quantizations) == 2
    for got, want in zip(fresh, quantized_weight_bytes(w1.detach(), w2.detach(), w3.detach())):
        assert torch.equal(got.view(torch.uint8), want)


@cpu
def test_mxfp8_shape_contract():
    assert ops.MXFP8_ALIGN == 128
    assert ops.unsupported_shape_reason(192, 128) is None          # bf16: 64-multiples
    for dim, hidden, words in [(192, 128, "dim (x's last dimension) to be a multiple of 128 for mxfp8, got 192"),
                               (256, 320, "hidden_dim to be a multiple of 128 for mxfp8, got 320")]:
        reason = ops.unsupported_shape_reason(dim, hidden, mxfp8=True)
        assert words in reason
        x, w1, w2, w3, ids, tw = make(8, dim, hidden, 2, 1)
        with pytest.raises(RuntimeError) as info:  # the op's own check says the same words
            ops.fused_moe_mxfp8(x.to(torch.float8_e4m3fn), torch.zeros(1), torch.cat([w1, w3], 1).to(torch.float8_e4m3fn),
                                torch.zeros(1), w2.to(torch.float8_e4m3fn), torch.zeros(1), *ops.moe_align(ids, 2), tw,
                                torch.empty_like(x), 1)
        assert reason in str(info.value)
        with pytest.raises(RuntimeError) as info:
            ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True)
        assert reason in str(info.value)


@cpu
def test_mxfp8_bad_arguments_name_the_argument():
    x, w1, w2, w3, ids, tw = make(16, 128, 128, 4, 2)
    xq, xs, wq, ws, w2q, w2s = mx_operands(x, w1, w2, w3)
    s, e, n = ops.moe_align(ids, 4)
    base = dict(x=xq, x_scales=xs, w=wq, w_scales=ws, w2=w2q, w2_scales=w2s, sorted_token_ids=s, expert_ids=e,
                num_tokens_post_padded=n, topk_weights=tw, out=torch.empty_like(x), top_k=2)
    for change, message in [(dict(x=x), "x must be float8_e4m3fn"),
                            (dict(w_scales=ops.unpack_scales_blocked(ws)), "w_scales must be pack_scales_blocked's layout"),
                            (dict(x_scales=xs[:, :2]), r"x_scales must have shape \(M, dim / 32\)"),
                            (dict(w2_scales=w2s.float()), "w2_scales must be float8_e8m0fnu"),
                            (dict(block_m=64), "block_m must be BLOCK_M=128")]:
        with pytest.raises(RuntimeError, match=message):
            ops.fused_moe_mxfp8(**{**base, **change})


# mxfp8 on the GPU
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_quantize_mxfp8_matches_cpu_bitwise():
    g = torch.Generator().manual_seed(40)
    t = torch.randn(999, 4 * MX, generator=g) * torch.exp2(torch.randint(-40, 40, (999, 1), generator=g).float())
    t = torch.cat([t, special_blocks().repeat(1, 4)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # block 32 / 128 from a 16-byte aligned start: 4 / 16 lanes per block; another block size, or a start 2 / 4
        # bytes past alignment (a contiguous view at offset 1): one thread per block. Same bytes as the CPU op.
        flat = torch.cat([t.new_zeros(1), t.flatten()]).to(dtype).cuda()
        for tc, block in ((t.to(dtype).cuda(), MX), (t.to(dtype).cuda(), ops.MXFP8_ALIGN), (t.to(dtype).cuda(), 2 * MX),
                          (flat[1:].view(t.shape), MX)):
            q, s = ops.quantize_mxfp8(tc.cpu(), block)
            qc, sc = ops.quantize_mxfp8(tc, block)
            assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)), (dtype, block, tc.data_ptr() % 16)
            assert torch.equal(sc.cpu().view(torch.uint8), s.view(torch.uint8)), (dtype, block, tc.data_ptr() % 16)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_share_exponents_matches_cpu_bitwise():
    _, q, s = share_cases()
    want_q, want_s = ops.share_exponents_mxfp8(q, s)
    got_q, got_s = ops.share_exponents_mxfp8(q.cuda(), s.cuda())
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s.cpu().view(torch.uint8), want_s.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("case", range(4))
def test_cuda_mxfp8_numerics(case):
    label, problem, start = mx_routing_cases("cuda")[case]
    check_mx_numerics(*problem, f"cuda {label}", expert_start=start)
    check_mx_numerics(*problem, f"cuda {label} deterministic", expert_start=start, deterministic=True)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("shape", [(256, 2048, 768, 16, 8), (1000, 2048, 768, 128, 8), (77, 512, 384, 8, 2),
                                   (300, 7168, 2048, 8, 4)])
def test_cuda_mxfp8_numerics_model_like(shape):
    T, dim, hidden, E, top_k = shape
    check_mx_numerics(*make(T, dim, hidden, E, top_k, "cuda", seed=41), f"cuda {shape}")


def mixed_exponent_operands(x, w1, w2, w3):
    """Shared exponents for x and most of the weights, per-32 scales for expert 1's w and the w2 rows of experts 3 and
    4 past row 128 (the down kernel's second column tile): the kernels' fast and per-32 paths stage by stage."""
    xq, xs, wq, ws, w2q, w2s = mx_operands(x, w1, w2, w3, ops.MXFP8_ALIGN)
    pq, ps, p2q, p2s = mx_operands(x, w1, w2, w3)[2:]
    wq[1], ws[1] = pq[1], ps[1]
    w2q[3:5, 128:], w2s[3:5, :, 128:] = p2q[3:5, 128:], p2s[3:5, :, 128:]
    def shared(packed):  # pack_scales_blocked's (..., 4): one value per 128 of K
        b = packed.view(torch.uint8)
        return bool((b == b[..., :1]).all())
    assert shared(xs.view(-1, 4)) and shared(ws[0]) and not shared(ws[1]) and shared(w2s[2]) and not shared(w2s[3])
    return xq, xs, wq, ws, w2q, w2s


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("exponents", ["per 32", "shared", "mixed"])
def test_cuda_fused_moe_mxfp8_matches_cpu(exponents):
    x, w1, w2, w3, ids, tw = make(500, 256, 384, 6, 2, seed=42)
    s, e, n = ops.moe_align(ids, 6)
    operands = {"per 32": lambda: mx_operands(x, w1, w2, w3),
                "shared": lambda: mx_operands(x, w1, w2, w3, ops.MXFP8_ALIGN),
                "mixed": lambda: mixed_exponent_operands(x, w1, w2, w3)}[exponents]()
    want = ops.fused_moe_mxfp8(*operands, s, e, n, tw, torch.empty_like(x), 2)
    out = torch.full_like(x, float("nan")).cuda()
    got = ops.fused_moe_mxfp8(*(t.cuda() for t in operands), s.cuda(), e.cuda(), n.cuda(), tw.cuda(), out, 2)
    base = mx_baseline(x, w1, w2, w3, ids, tw)
    ref = moe_per_expert(x.double(), w1.double(), w2.double(), w3.double(), ids, tw.double())
    assert_error_ratio(f"cuda fused_moe_mxfp8 ({exponents} exponents)", got, base, ref, MAX_RATIO)
    # the re-quantization of h can round a few elements differently from the CPU's fp32 GEMM: compare loosely
    torch.testing.assert_close(got.cpu(), want, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_fused_moe_mxfp8_rare_values_match_cpu():
    # Operands away from the usual range: scales far above 1 (x of magnitude ~2^20; scale bytes > 134, the bound of a
    # single bf16 multiplier of the measured dequantizing kernel, docs/notes/flash_moe.md), e4m3 subnormal elements
    # (blocks spanning 2^-16 of their amax) and a NaN element under a finite scale (its token's output is NaN on both
    # devices).
    x, w1, w2, w3, ids, tw = make(300, 256, 384, 6, 2, seed=44)
    x = (x.float() * 2.0**20).to(torch.bfloat16)
    x[:, :32] *= torch.exp2(-torch.arange(32) / 2).to(torch.bfloat16)
    w1[:, :, 32:64] *= torch.exp2(-torch.arange(32) / 2).to(torch.bfloat16)
    xq, xs, wq, ws, w2q, w2s = mx_operands(x, w1, w2, w3)
    assert xs.view(torch.uint8).max() > 127 + 7
    assert ((xq.view(torch.uint8) & 0x78) == 0).logical_and(xq.view(torch.uint8) & 0x7 != 0).any()  # subnormals
    xq.view(torch.uint8)[7, 5] = 0x7F
    s, e, n = ops.moe_align(ids, 6)
    operands = (xq, xs, wq, ws, w2q, w2s)
    want = ops.fused_moe_mxfp8(*operands, s, e, n, tw, torch.empty_like(x), 2).float()
    out = torch.full_like(x, float("nan")).cuda()
    got = ops.fused_moe_mxfp8(*(t.cuda() for t in operands), s.cuda(), e.cuda(), n.cuda(), tw.cuda(), out, 2)
    got = got.cpu().float()
    assert want[7].isnan().all() and torch.equal(got.isnan(), want.isnan())
    # the re-quantization of h rounds a few elements differently from the CPU's fp32 GEMM (a relative step of 2^-3 of
    # one element of h): compare the whole output
    finite = ~want.isnan()
    assert (got[finite] - want[finite]).norm() / want[finite].norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_mxfp8_deterministic_is_bitwise_reproducible():
    x, w1, w2, w3, ids, tw = make(2048, 1024, 512, 32, 8, "cuda", seed=43)
    runs = [ops.moe(x, w1, w2, w3, ids, tw, deterministic=True, mxfp8=True) for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(runs[0], other)
