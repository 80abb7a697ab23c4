"""flash_moe under bad and edge inputs (issue 22): a meta tensor mixed with real ones fails as the ops' checks do
(the fakes run them), NaN / inf weights on slots that are not routed contribute nothing, swiglu_backward's invalid
rows stay zero whatever gate_up holds, moe refuses a double backward, fused_moe_mxfp8 compiles with inductor on
float8 operands. The fuzz-style sweep over every public function and raw op: tests/test_flash_moe_fuzz.py."""
from __future__ import annotations

import pytest
import torch

from prime_kernels_core.testing import kernel_module

KERNEL = "flash_moe"
ops = kernel_module(KERNEL, "prime_kernels_flash_moe.ops")
cpu = pytest.mark.kernel(KERNEL, device="cpu")
M, DIM, HIDDEN, E, TOP_K = 16, 128, 128, 4, 2


def problem(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, DIM, generator=g).to(torch.bfloat16)
    w1, w3 = ((torch.randn(E, HIDDEN, DIM, generator=g) / DIM**0.5).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, DIM, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, TOP_K, generator=g)
    return [t.to(device) for t in (x, w1, w2, w3, ids, tw)]


def mx_operands(x, w1, w2, w3):
    xq, xs = ops.quantize_mxfp8(x, exponent_block=ops.MXFP8_ALIGN)
    wq, ws = ops.quantize_mxfp8(torch.cat([w1, w3], 1), exponent_block=ops.MXFP8_ALIGN)
    w2q, w2s = ops.quantize_mxfp8(w2, exponent_block=ops.MXFP8_ALIGN)
    return xq, xs, wq, ops.pack_scales_blocked(ws), w2q, ops.pack_scales_blocked(w2s)


def raw_op_calls():
    """(name, op, args) of every flash_moe op on valid CPU arguments."""
    x, w1, w2, w3, ids, tw = problem()
    align = list(ops.moe_align(ids, E))
    w = torch.cat([w1, w3], 1)
    out = torch.empty_like(x)
    mx = list(mx_operands(x, w1, w2, w3))
    q, s = ops.quantize_mxfp8(x)
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, TOP_K, ops.BLOCK_M)
    f = torch.ops.flash_moe
    return [
        ("fused_moe_bf16", f.fused_moe_bf16, [x, w, w2, *align, tw, out, TOP_K, ops.BLOCK_M, 64, 64, 3, 1, 1, True]),
        ("moe_forward", f.moe_forward, [x, w1, w3, w2, *align, tw, TOP_K, ops.BLOCK_M, False, True]),
        ("moe_gate_up", f.moe_gate_up, [x, w1, w3, *align, TOP_K, ops.BLOCK_M]),
        ("swiglu_backward", f.swiglu_backward,
         [gate_up, torch.randn(M * TOP_K, HIDDEN).to(torch.bfloat16), tw.reshape(-1),
          torch.ones(M * TOP_K, dtype=torch.bool)]),
        ("moe_grad_weight", f.moe_grad_weight,
         [gate_up[:, :HIDDEN], x, torch.arange(M * TOP_K, dtype=torch.int32) // TOP_K,
          torch.tensor([5, 5, 20, M * TOP_K], dtype=torch.int32), False]),
        ("share_exponents_mxfp8", f.share_exponents_mxfp8, [q, s]),
        ("fused_moe_mxfp8", f.fused_moe_mxfp8, [*mx, *align, tw, out, TOP_K, ops.BLOCK_M, 64, 4, 4, 1, True]),
        ("moe_forward_mxfp8", f.moe_forward_mxfp8, [*mx, *align, tw, TOP_K, ops.BLOCK_M, False]),
        *lora_op_calls(x, w1, w2, w3, ids, tw),
    ]


def lora_op_calls(x, w1, w2, w3, ids, tw, n=2, r=8):
    """(name, op, args) of the LoRA ops: n adapters, tokens alternating, slots aligned by (expert, adapter) group."""
    from prime_kernels_flash_moe.lora import group_ids

    g = torch.Generator().manual_seed(5)
    pair = lambda n_in, n_out: [(torch.randn(n, E, r, n_in, generator=g) / n_in**0.5).to(torch.bfloat16),
                                (torch.randn(n, E, n_out, r, generator=g) / r**0.5).to(torch.bfloat16)]
    gate, up, down = pair(DIM, HIDDEN), pair(DIM, HIDDEN), pair(HIDDEN, DIM)
    scaling = torch.tensor([0.5, 2.0])
    align = list(ops.moe_align(group_ids(ids, torch.arange(M) % n, E, n, 0, E), E * n))
    f = torch.ops.flash_moe
    gate_up = f.moe_lora_gate_up(x, w1, w3, *align, TOP_K, ops.BLOCK_M, scaling, *gate, *up)[0]
    grad_out = torch.randn(M, DIM, generator=g).to(torch.bfloat16)
    dg, du = f.moe_lora_grad_gate_up(grad_out, w2, gate_up, *align, tw, TOP_K, ops.BLOCK_M, scaling, *down)[0].split(
        HIDDEN, 1)
    return [
        ("moe_lora_forward", f.moe_lora_forward,
         [x, w1, w3, w2, *align, tw, TOP_K, ops.BLOCK_M, False, True, -1, scaling, *gate, *up, *down]),
        ("moe_lora_gate_up", f.moe_lora_gate_up, [x, w1, w3, *align, TOP_K, ops.BLOCK_M, scaling, *gate, *up]),
        ("moe_lora_grad_gate_up", f.moe_lora_grad_gate_up,
         [grad_out, w2, gate_up, *align, tw, TOP_K, ops.BLOCK_M, scaling, *down]),
        ("moe_lora_grad_x", f.moe_lora_grad_x,
         [dg, du, w1, w3, *align, TOP_K, ops.BLOCK_M, False, scaling, *gate, *up]),
    ]


def meta_cases():
    cases = []
    for name, op, args in raw_op_calls():
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                cases.append(pytest.param(op, args, i, id=f"{name}-arg{i}"))
    return cases


@cpu
@pytest.mark.parametrize("op, args, index", meta_cases())
def test_raw_op_with_one_meta_tensor_raises(op, args, index):
    """The dispatcher runs the fake for a meta tensor among CPU ones: it must raise, naming the device mismatch."""
    args = list(args)
    args[index] = args[index].to("meta")
    with pytest.raises(RuntimeError, match=r"device (cpu|meta), got (one on )?(meta|cpu)"):
        op(*args)


@cpu
@pytest.mark.parametrize("name", ["x", "w1", "w2", "w3", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("mxfp8", [False, True])
def test_moe_with_one_meta_tensor_raises(name, mxfp8):
    args = dict(zip(("x", "w1", "w2", "w3", "topk_ids", "topk_weights"), problem()))
    args[name] = args[name].to("meta")
    with pytest.raises(RuntimeError, match=r"device (cpu|meta), got (meta|cpu)"):
        ops.moe(*args.values(), mxfp8=mxfp8)


@cpu
def test_public_mxfp8_helpers_with_one_meta_tensor_raise():
    x = problem()[0]
    q, s = ops.quantize_mxfp8(x)
    for data, scales in ((q.to("meta"), s), (q, s.to("meta"))):
        with pytest.raises(RuntimeError, match="scales must be on data's device"):
            ops.share_exponents_mxfp8(data, scales)
        with pytest.raises(RuntimeError, match="scales must be on data's device"):
            ops.dequantize_mxfp8(data, scales)


def fake_agrees_with_op(op, args):
    """The fake (through FakeTensorMode) raises exactly when the CPU op does, with the same message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def outcome(fn):
        try:
            fn()
            return None
        except RuntimeError as e:
            return str(e).split("\n")[0]

    real = outcome(lambda: op(*args))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = outcome(lambda: op(*fake_args))
    return real, fake


@cpu
@pytest.mark.parametrize("name, change", [
    ("fused_moe_bf16", lambda a: a.__setitem__(2, a[2][:, :, :64])),  # w2 hidden
    ("fused_moe_bf16", lambda a: a.__setitem__(6, a[6].double())),  # topk_weights dtype
    ("fused_moe_bf16", lambda a: a.__setitem__(7, a[7][:, :64])),  # out shape
    ("fused_moe_bf16", lambda a: a.__setitem__(9, 64)),  # block_m
    ("moe_forward", lambda a: a.__setitem__(4, a[4][:-1])),  # sorted_token_ids length
    ("moe_gate_up", lambda a: a.__setitem__(2, a[2][:, :64])),  # w3 shape
    ("swiglu_backward", lambda a: a.__setitem__(3, a[3].int())),  # valid dtype
    ("moe_grad_weight", lambda a: a.__setitem__(2, a[2].long())),  # row_token dtype
    ("moe_grad_weight", lambda a: a.__setitem__(1, a[1][:, :60])),  # source width
    ("moe_grad_weight", lambda a: a.__setitem__(3, a[3][:0])),  # no experts
    ("share_exponents_mxfp8", lambda a: a.__setitem__(1, a[1][:, :2])),  # scales shape
    ("fused_moe_mxfp8", lambda a: a.__setitem__(1, a[1][:, :2])),  # x_scales shape
    ("moe_forward_mxfp8", lambda a: a.__setitem__(3, a[3].view(torch.uint8)[..., :2])),  # w_scales shape
    ("moe_lora_forward", lambda a: a.__setitem__(15, a[15][..., :4])),  # b_gate rank differs from a_gate's
    ("moe_lora_forward", lambda a: a.__setitem__(13, a[13].double())),  # scaling dtype
    ("moe_lora_forward", lambda a: a.__setitem__(19, None)),  # a_down without b_down
    ("moe_lora_gate_up", lambda a: a.__setitem__(9, a[9][:, :, :4])),  # a_gate rank not a multiple of 8
    ("moe_lora_gate_up", lambda a: a.__setitem__(8, a[8][:1])),  # scaling: one adapter for two
    ("moe_lora_grad_gate_up", lambda a: a.__setitem__(10, a[10].float())),  # a_down dtype
    ("moe_lora_grad_x", lambda a: a.__setitem__(12, a[12][:, :3])),  # b_gate experts
    ("moe_lora_grad_x", lambda a: a.__setitem__(5, a[5][:-1])),  # expert_ids length
])
def test_fake_raises_what_the_op_raises(name, change):
    op, args = next((op, list(args)) for n, op, args in raw_op_calls() if n == name)
    change(args)
    real, fake = fake_agrees_with_op(op, args)
    assert real is not None and real == fake, (real, fake)


# ---------------------------------------------------------------------------------------------------------------
# NaN / inf weights on slots that are not routed
def poisoned_unrouted(device):
    """A problem whose unrouted slots (id -1, or an expert outside [expert_start, expert_start + E)) carry NaN and inf
    weights, and the same with those weights zero."""
    x, w1, w2, w3, ids, tw = problem(device, seed=3)
    ids = ids.clone() + E  # global ids of a second rank holding experts [E, 2E)
    ids[::3, 0] = -1
    ids[1::3, 1] = 0  # another rank's expert
    unrouted = (ids < E)
    bad = tw.clone()
    bad[unrouted] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device).repeat(
        int(unrouted.sum()))[:int(unrouted.sum())]
    clean = torch.where(unrouted, torch.zeros_like(tw), tw)
    return x, w1, w2, w3, ids, bad, clean


def check_unrouted_weights_contribute_nothing(device, deterministic):
    x, w1, w2, w3, ids, bad, clean = poisoned_unrouted(device)
    for mxfp8 in (False, True):
        outs, grads = [], []
        for tw in (bad, clean):
            leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, tw)]
            out = ops.moe(*leaves[:4], ids, leaves[4], expert_start=E, num_experts=2 * E, deterministic=deterministic,
                          mxfp8=mxfp8)
            outs.append(out)
            grads.append(torch.autograd.grad(out.float().sum(), leaves))
        assert outs[0].isfinite().all(), f"mxfp8={mxfp8}: NaN / inf on unrouted slots reached the output"
        if deterministic:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        else:  # fp32 atomics on CUDA: the order varies run to run, and a bf16 output may round one ulp either way
            scale = outs[1].float().abs().max().item()
            torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2**-7, atol=2**-8 * scale)
        for g_bad, g_clean in zip(*grads):
            assert g_bad.isfinite().all()
            torch.testing.assert_close(g_bad, g_clean, **({} if device == "cuda" else dict(rtol=0, atol=0)))
    # the raw fused ops, whose alignment skips the same slots
    align = ops.moe_align(ids, 2 * E, expert_start=E, num_local_experts=E)
    w = torch.cat([w1, w3], 1)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}  # the fused ops combine with fp32 atomics on CUDA
    mx = mx_operands(x, w1, w2, w3)
    for fused, operands in ((ops.fused_moe_bf16, (x, w, w2)), (ops.fused_moe_mxfp8, mx)):
        got = [fused(*operands, *align, tw, torch.full_like(x, float("nan")), TOP_K) for tw in (bad, clean)]
        assert got[0].isfinite().all(), fused.__name__
        torch.testing.assert_close(got[0], got[1], **exact)
    for op, operands in ((torch.ops.flash_moe.moe_forward, (x, w1, w3, w2)),
                         (torch.ops.flash_moe.moe_forward_mxfp8, mx)):
        got = [op(*operands, *align, tw, TOP_K, ops.BLOCK_M, True) for tw in (bad, clean)]  # deterministic combine
        got = [g[0] if isinstance(g, (tuple, list)) else g for g in got]
        assert got[0].isfinite().all(), str(op)
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


@cpu
def test_cpu_unrouted_weights_contribute_nothing():
    check_unrouted_weights_contribute_nothing("cpu", deterministic=True)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_unrouted_weights_contribute_nothing(deterministic):
    check_unrouted_weights_contribute_nothing("cuda", deterministic)


def check_swiglu_backward_invalid_rows(device):
    rows = 64
    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(rows, 2 * HIDDEN, generator=g).to(torch.bfloat16)
    valid = torch.rand(rows, generator=g) > 0.3
    gate_up[~valid, :3] = float("nan")
    gate_up[~valid, HIDDEN:HIDDEN + 3] = float("inf")  # u
    gate_up[~valid, 5] = -float("inf")  # g
    grad_h = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    p = torch.rand(rows, generator=g)
    p[~valid] = float("nan")
    got = torch.ops.flash_moe.swiglu_backward(*(t.to(device) for t in (gate_up, grad_h, p, valid)))
    for name, t in zip(("grad_gate", "grad_up", "weighted_h", "grad_row_weights"), got):
        t = t.cpu()
        assert (t[~valid] == 0).all(), f"{name}: rows marked invalid must be zero whatever gate_up holds there"
        assert t[valid].isfinite().all(), name


@cpu
def test_cpu_swiglu_backward_invalid_rows_are_zero_whatever_gate_up_holds():
    check_swiglu_backward_invalid_rows("cpu")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_swiglu_backward_invalid_rows_are_zero_whatever_gate_up_holds():
    check_swiglu_backward_invalid_rows("cuda")


# ---------------------------------------------------------------------------------------------------------------
@cpu
@pytest.mark.parametrize("recompute, mxfp8", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("wrt", ["all", "w2", "bf16 topk_weights"])
@pytest.mark.parametrize("loss", ["square", "linear"])
def test_moe_double_backward_raises(recompute, mxfp8, wrt, loss):
    x, w1, w2, w3, ids, tw = problem(seed=4)
    if wrt == "bf16 topk_weights":  # its float copy inside moe has no grad history: the anchor is the caller's tensor
        tw = tw.to(torch.bfloat16).requires_grad_()
        leaves = [x.requires_grad_(), tw]
    else:
        x, w1, w2, w3, tw = (t.requires_grad_() for t in (x, w1, w2, w3, tw))
        leaves = [w2] if wrt == "w2" else [x, w1, w2, w3, tw]
    out = ops.moe(x, w1, w2, w3, ids, tw, recompute_gate_up=recompute, mxfp8=mxfp8)
    # a linear loss makes grad_out a constant: the error must then come from the leaves (mxfp8 saved only quantized
    # copies and a float copy of topk_weights, so its second derivatives were silently zero)
    objective = out.float().square().sum() if loss == "square" else (out.float() * torch.randn_like(out.float())).sum()
    grads = torch.autograd.grad(objective, leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="moe: double backward is not supported"):
        sum(g.float().square().sum() for g in grads).backward()


@cpu
def test_moe_first_order_gradients_under_create_graph_are_unchanged():
    x, w1, w2, w3, ids, tw = (t.requires_grad_() if t.is_floating_point() else t for t in problem(seed=5))
    leaves = [x, w1, w2, w3, tw]
    out = ops.moe(x, w1, w2, w3, ids, tw)
    plain = torch.autograd.grad(out.float().square().sum(), leaves)
    out = ops.moe(x, w1, w2, w3, ids, tw)
    graphed = torch.autograd.grad(out.float().square().sum(), leaves, create_graph=True)
    for a, b in zip(plain, graphed):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.kernel(KERNEL)])])
def test_fused_moe_mxfp8_compiles_with_inductor_on_float8_operands(device):
    x, w1, w2, w3, ids, tw = problem(device, seed=6)
    align = ops.moe_align(ids, E)
    mx = mx_operands(x, w1, w2, w3)
    assert mx[0].dtype == torch.float8_e4m3fn and mx[1].dtype == torch.float8_e8m0fnu

    def run(*operands):
        return ops.fused_moe_mxfp8(*operands, *align, tw, torch.empty(M, DIM, dtype=torch.bfloat16, device=device),
                                   TOP_K)

    eager = run(*mx)
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="inductor")(*mx)
    torch.testing.assert_close(compiled, eager, **({} if device == "cuda" else dict(rtol=0, atol=0)))  # atomics


@cpu
@pytest.mark.parametrize("expert_start, num_experts, words", [
    (6, 8, r"moe: the local experts \[expert_start, expert_start \+ 4\) = \[6, 10\) \(4: w1's expert count\) must lie "
           r"within the num_experts = 8 global experts; lower expert_start to at most 4 or raise num_experts"),
    (0, 3, r"= \[0, 4\) \(4: w1's expert count\) must lie within the num_experts = 3 global experts"),
    (-1, None, r"moe: expert_start must be >= 0 \(the global id of w1's first expert\), got -1"),
])
def test_an_expert_range_past_num_experts_names_moes_own_arguments(expert_start, num_experts, words):
    """Not moe_align's "num_local_experts must be in [1, 2]", an argument moe() does not have (issue 61, item 10)."""
    x, w1, w2, w3, ids, tw = problem()
    with pytest.raises(ValueError, match=words):
        ops.moe(x, w1, w2, w3, ids, tw, expert_start=expert_start, num_experts=num_experts)
