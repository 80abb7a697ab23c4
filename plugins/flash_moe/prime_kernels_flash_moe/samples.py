"""Sample inputs for the conformance kit (fake-tensor runs, opcheck, torch.compile of the surface)."""
import torch

KERNEL = "flash_moe"


def problem(device, tokens=5, dim=64, hidden=64, experts=3, top_k=2, seed=0, requires_grad=False):
    """(x, w1, w2, w3, topk_ids, topk_weights): bf16 tensors, int32 ids with one unrouted (-1) slot."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, dim, generator=g) * 0.5).to(torch.bfloat16)
    w1 = (torch.randn(experts, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w3 = (torch.randn(experts, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, dim, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if tokens > 1:
        ids[1, 0] = -1
    tw = torch.rand(tokens, top_k, generator=g).softmax(-1)
    tensors = [t.to(device) for t in (x, w1, w2, w3, ids, tw)]
    if requires_grad:
        for i in (0, 1, 2, 3, 5):
            tensors[i].requires_grad_(True)
    return tensors


def mxfp8_operands(ops, x, w1, w2, w3):
    """(x, x_scales, w, w_scales, w2, w2_scales) in mxfp8, weight scales packed for the kernels."""
    xq, xs = ops.quantize_mxfp8(x)
    wq, ws = ops.quantize_mxfp8(torch.cat([w1, w3], 1))
    w2q, w2s = ops.quantize_mxfp8(w2)
    return xq, xs, wq, ops.pack_scales_blocked(ws), w2q, ops.pack_scales_blocked(w2s)


def op_samples(kernel, device):
    from . import ops

    if kernel != KERNEL:
        return []
    x, w1, w2, w3, ids, tw = problem(device)
    w = torch.cat([w1, w3], 1)
    sorted_ids, eids, ntpp = ops.moe_align(ids, w1.shape[0])
    x1, w11, w21, w31, ids1, tw1 = problem(device, tokens=1, experts=2, top_k=1, seed=1)
    s1, e1, n1 = ops.moe_align(ids1, 2)
    return [
        ("moe_align", (ids, 3, ops.BLOCK_M, 1, 0, -1), {}),
        ("moe_align", (ids, 3, 16, 2, 1, 2), {}),  # EP: experts [1, 3), bpc 2
        ("moe_align", (ids, 3, 16, 1, 0, -1, 2), {}),  # experts start on even blocks
        ("moe_align", (ids[:0], 3, ops.BLOCK_M, 1, 0, -1), {}),  # no tokens
        ("fused_moe_bf16", (x, w, w2, sorted_ids, eids, ntpp, tw, torch.empty_like(x), 2, ops.BLOCK_M, 128, 64, 4, 1,
                            1, True), {}),
        ("moe_forward", (x, w1, w3, w2, sorted_ids, eids, ntpp, tw, 2, ops.BLOCK_M, False), {}),
        ("moe_forward", (x, w1, w3, w2, sorted_ids, eids, ntpp, tw, 2, ops.BLOCK_M, True), {}),
        ("moe_forward", (x, w1, w3, w2, sorted_ids, eids, ntpp, tw, 2, ops.BLOCK_M, False, True), {}),
        # expert parallelism: the launch rules' global expert count
        ("moe_forward", (x, w1, w3, w2, sorted_ids, eids, ntpp, tw, 2, ops.BLOCK_M, False, True), {"num_experts": 12}),
        ("moe_forward", (x1, w11, w31, w21, s1, e1, n1, tw1, 1, ops.BLOCK_M, False), {}),
        ("moe_gate_up", (x, w1, w3, sorted_ids, eids, ntpp, 2, ops.BLOCK_M), {}),
        ("moe_gate_up", (x, w1, w3, sorted_ids, eids, ntpp, 2, ops.BLOCK_M), {"num_experts": 12}),
        ("moe_gate_up", (x1, w11, w31, s1, e1, n1, 1, ops.BLOCK_M), {}),
        *grad_gate_up_samples(ops, x, w1, w2, w3, tw, (sorted_ids, eids, ntpp), 2),
        *grad_gate_up_samples(ops, x1, w11, w21, w31, tw1, (s1, e1, n1), 1),
        *family_samples(ops, x, w1, w2, w3, tw, (sorted_ids, eids, ntpp)),
        *lora_samples(ops, x, w1, w2, w3, ids, tw),
        *swiglu_backward_samples(device),
        *grad_weight_samples(device),
        *mxfp8_samples(ops, device),
    ]


def grad_gate_up_samples(ops, x, w1, w2, w3, tw, align, top_k):
    """The backward's dH op, and dx from the two halves of its dg | du rows (read in place: both combine orders) and
    from contiguous copies."""
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, top_k, ops.BLOCK_M)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(x.dtype).to(x.device)
    dgu, _, _ = torch.ops.flash_moe.moe_grad_gate_up(grad_out, w2, gate_up, *align, tw, top_k, ops.BLOCK_M)
    dg, du = dgu.split(w1.shape[1], 1)
    global_experts = {"num_experts": 4 * w1.shape[0]}  # expert parallelism: the launch rules' global count
    return [("moe_grad_gate_up", (grad_out, w2, gate_up, *align, tw, top_k, ops.BLOCK_M), {}),
            ("moe_grad_gate_up", (grad_out, w2, gate_up, *align, tw, top_k, ops.BLOCK_M), global_experts),
            ("moe_grad_x", (dg, du, w1, w3, *align, top_k, ops.BLOCK_M, False), {}),
            ("moe_grad_x", (dg, du, w1, w3, *align, top_k, ops.BLOCK_M, True), global_experts),
            ("moe_grad_x", (dg.contiguous(), du.contiguous(), w1, w3, *align, top_k, ops.BLOCK_M, False), {})]


def family_samples(ops, x, w1, w2, w3, tw, align):
    """The family arguments of the forward and backward ops: gpt-oss's activation with biases (the halves of an
    interleaved bias: strided views), relu2 without up weights, and their dH / dx ops."""
    g = torch.Generator().manual_seed(10)
    E, hidden, dim = w1.shape
    b1 = torch.randn(E, 2 * hidden, generator=g).to(torch.bfloat16).to(x.device)
    b_gate, b_up = b1[:, 0::2], b1[:, 1::2]
    b2 = torch.randn(E, dim, generator=g).to(torch.bfloat16).to(x.device)
    gpt_oss = {"activation": "gpt_oss", "alpha": 1.702, "limit": 7.0}
    relu2 = {"activation": "relu2"}
    gate_up = torch.ops.flash_moe.moe_gate_up(x, w1, w3, *align, 2, ops.BLOCK_M, -1, b_gate, b_up)
    gate_only = torch.ops.flash_moe.moe_gate_up(x, w1, None, *align, 2, ops.BLOCK_M)
    grad_out = torch.randn(x.shape, generator=g).to(x.dtype).to(x.device)
    dg = torch.ops.flash_moe.moe_grad_gate_up(grad_out, w2, gate_only, *align, tw, 2, ops.BLOCK_M, -1, "relu2")[0]
    return [("moe_forward", (x, w1, w3, w2, *align, tw, 2, ops.BLOCK_M, False, True),
             dict(gpt_oss, b_gate=b_gate, b_up=b_up, b2=b2)),
            ("moe_forward", (x, w1, None, w2, *align, tw, 2, ops.BLOCK_M, True, True), dict(relu2, b_gate=b_gate)),
            ("moe_gate_up", (x, w1, w3, *align, 2, ops.BLOCK_M), {"b_gate": b_gate, "b_up": b_up}),
            ("moe_gate_up", (x, w1, None, *align, 2, ops.BLOCK_M), {}),
            ("moe_grad_gate_up", (grad_out, w2, gate_up, *align, tw, 2, ops.BLOCK_M), gpt_oss),
            ("moe_grad_gate_up", (grad_out, w2, gate_only, *align, tw, 2, ops.BLOCK_M), relu2),
            ("moe_grad_x", (dg, None, w1, None, *align, 2, ops.BLOCK_M, True), {})]


def adapters(device, n, E, dim, hidden, ranks=(8, 16, 8), seed=11, gated=True):
    """A MoeLora's six adapter tensors (bf16; the up pair None when not gated) and its (n,) scaling."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (dim, hidden, ranks[0]), "up": (dim, hidden, ranks[1]), "down": (hidden, dim, ranks[2])}
    out = []
    for projection, (n_in, n_out, r) in shapes.items():
        if projection == "up" and not gated:
            out += [None, None]
            continue
        out.append((torch.randn(n, E, r, n_in, generator=g) / n_in**0.5).to(torch.bfloat16).to(device))
        out.append((torch.randn(n, E, n_out, r, generator=g) / r**0.5).to(torch.bfloat16).to(device))
    return out, torch.linspace(0.5, 2.0, n).to(device)


def lora_samples(ops, x, w1, w2, w3, ids, tw):
    """The LoRA ops on two adapters (the slots aligned by (expert, adapter) group), one adapter on gate and down only,
    relu2 (no up adapter), and the backward ops from their rows."""
    from .lora import group_ids

    E, hidden, dim = w1.shape
    (a_g, b_g, a_u, b_u, a_d, b_d), scaling = adapters(x.device, 2, E, dim, hidden)
    adapter_ids = torch.arange(x.shape[0], device=x.device) % 2
    groups = group_ids(ids, adapter_ids, E, 2, 0, E)
    align = ops.moe_align(groups, 2 * E)
    one = scaling[:1]
    align1 = ops.moe_align(ids, E)
    pairs1 = (a_g[:1], b_g[:1], None, None, a_d[:1], b_d[:1])
    gate_up, rows = torch.ops.flash_moe.moe_lora_gate_up(x, w1, w3, *align, 2, ops.BLOCK_M, scaling, a_g, b_g, a_u,
                                                         b_u)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(x.dtype).to(x.device)
    dgu = torch.ops.flash_moe.moe_lora_grad_gate_up(grad_out, w2, gate_up, *align, tw, 2, ops.BLOCK_M, scaling, a_d,
                                                    b_d)[0]
    dg, du = dgu.split(hidden, 1)
    relu2 = {"activation": "relu2"}
    return [
        ("moe_lora_forward", (x, w1, w3, w2, *align, tw, 2, ops.BLOCK_M, False, True, -1, scaling, a_g, b_g, a_u, b_u,
                              a_d, b_d), {}),
        ("moe_lora_forward", (x, w1, w3, w2, *align1, tw, 2, ops.BLOCK_M, True, False, 4 * E, one, *pairs1), {}),
        ("moe_lora_forward", (x, w1, None, w2, *align, tw, 2, ops.BLOCK_M, False, True, -1, scaling, a_g, b_g, None,
                              None, a_d, b_d), relu2),
        ("moe_lora_gate_up", (x, w1, w3, *align, 2, ops.BLOCK_M, scaling, a_g, b_g, a_u, b_u), {}),
        ("moe_lora_gate_up", (x, w1, None, *align1, 2, ops.BLOCK_M, one, None, None, None, None), {}),
        ("moe_lora_grad_gate_up", (grad_out, w2, gate_up, *align, tw, 2, ops.BLOCK_M, scaling, a_d, b_d), {}),
        ("moe_lora_grad_gate_up", (grad_out, w2, gate_up[:, :hidden], *align, tw, 2, ops.BLOCK_M, scaling, None,
                                   None), relu2),
        ("moe_lora_grad_x", (dg, du, w1, w3, *align, 2, ops.BLOCK_M, False, scaling, a_g, b_g, a_u, b_u), {}),
        ("moe_lora_grad_x", (dg, None, w1, None, *align, 2, ops.BLOCK_M, True, scaling, a_g, b_g, None, None), {}),
    ]


def grad_weight_samples(device, rows=21, tokens=9, width=64):
    """The weight-gradient op: both orientations, an expert without rows, a -1 token, fp32 output."""
    g = torch.Generator().manual_seed(9)
    r = torch.randn(rows, width, generator=g).to(torch.bfloat16).to(device)
    source = torch.randn(tokens, 2 * width, generator=g).to(torch.bfloat16).to(device)
    row_token = torch.randint(0, tokens, (rows,), generator=g, dtype=torch.int32)
    row_token[3] = -1
    ends = torch.tensor([6, 6, 19], dtype=torch.int32)
    args = (r, source, row_token.to(device), ends.to(device))
    return [("moe_grad_weight", (*args, False), {}), ("moe_grad_weight", (*args, True, True), {})]


def swiglu_backward_samples(device, rows=7, hidden=64):
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 2).to(torch.bfloat16).to(device)
    grad_h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)
    row_weights = torch.rand(rows, generator=g).to(device)
    valid = (torch.arange(rows) < rows - 2).to(device)
    return [("swiglu_backward", (gate_up, grad_h, row_weights, valid), {}),
            ("swiglu_backward", (gate_up[:0], grad_h[:0], row_weights[:0], valid[:0]), {})]


def mxfp8_samples(ops, device):
    x, w1, w2, w3, ids, tw = problem(device, dim=128, hidden=128, seed=5)
    # fp8 operands as their uint8 bytes: opcheck's schema check compares inputs with allclose, which float8 types
    # lack on CPU (the ops take either)
    mx = [t.view(torch.uint8) for t in mxfp8_operands(ops, x, w1, w2, w3)]
    s, e, n = ops.moe_align(ids, w1.shape[0])
    return [
        ("quantize_mxfp8", (x, ops.MXFP8_SCALE_BLOCK), {}),
        ("quantize_mxfp8", (w2.float().reshape(-1, 64), 16), {}),
        ("share_exponents_mxfp8", (mx[0], mx[1]), {}),
        ("share_exponents_mxfp8", tuple(t.view(torch.uint8) for t in ops.quantize_mxfp8(w1)), {}),
        ("fused_moe_mxfp8", (*mx, s, e, n, tw, torch.empty_like(x), 2, ops.BLOCK_M, 64, 4, 4, 1, True), {}),
        ("moe_forward_mxfp8", (*mx, s, e, n, tw, 2, ops.BLOCK_M, False), {}),
        ("moe_forward_mxfp8", (*mx, s, e, n, tw, 2, ops.BLOCK_M, True), {}),
    ]


def surface_samples(kernel, device):
    from . import ops

    if kernel != KERNEL:
        return []

    def fused(x, w1, w2, w3, ids, tw):
        sorted_ids, eids, ntpp = ops.moe_align(ids, w1.shape[0])
        out = torch.empty_like(x)
        return ops.fused_moe_bf16(x, torch.cat([w1, w3], 1), w2, sorted_ids, eids, ntpp, tw, out, ids.shape[1])

    def deterministic(x, w1, w2, w3, ids, tw):
        return ops.moe(x, w1, w2, w3, ids, tw, deterministic=True)

    def fused_mxfp8(x, w1, w2, w3, ids, tw):
        sorted_ids, eids, ntpp = ops.moe_align(ids, w1.shape[0])
        out = torch.empty_like(x)
        return ops.fused_moe_mxfp8(*mxfp8_operands(ops, x, w1, w2, w3), sorted_ids, eids, ntpp, tw, out, ids.shape[1])

    def mxfp8(x, w1, w2, w3, ids, tw):
        return ops.moe(x, w1, w2, w3, ids, tw, mxfp8=True)

    def gpt_oss(x, w1, w2, w3, ids, tw):  # gpt-oss's transposed, interleaved weights with biases
        E, hidden, dim = w1.shape
        gate_up = torch.stack([w1, w3], 2).flatten(1, 2).transpose(1, 2)
        b1 = torch.linspace(-1, 1, E * 2 * hidden, device=x.device).view(E, 2 * hidden).to(x.dtype)
        b2 = torch.linspace(1, -1, E * dim, device=x.device).view(E, dim).to(x.dtype)
        return ops.moe(x, gate_up, w2.transpose(1, 2), None, ids, tw, activation="gpt_oss", b1=b1, b2=b2,
                       layout=ops.GPT_OSS_LAYOUT)

    def relu2(x, w1, w2, w3, ids, tw):
        return ops.moe(x, w1, w2, None, ids, tw, activation="relu2")

    def presorted(x, w1, w2, w3, ids, tw):
        counts = torch.tensor([2, 0, 2], device=x.device)
        return ops.moe_sorted(x, w1, w2, w3, counts, row_weights=tw[:, 0])

    frozen_base = problem(device, requires_grad=True, seed=10)
    for weight in frozen_base[1:4]:
        weight.requires_grad_(False)
    E, hidden, dim = frozen_base[1].shape
    lora_tensors, lora_scaling = adapters(device, 2, E, dim, hidden, seed=13)
    adapter_ids = torch.arange(frozen_base[0].shape[0], device=device) % 2

    def with_lora(x, w1, w2, w3, ids, tw):  # two adapters, tokens alternating, frozen base weights
        return ops.moe(x, w1, w2, w3, ids, tw, lora=ops.MoeLora(lora_scaling, *lora_tensors, adapter_ids=adapter_ids))
    grad = problem(device, requires_grad=True, seed=2)
    not_gated = problem(device, requires_grad=True, seed=8)
    not_gated[3].requires_grad_(False)  # relu2 reads no w3
    return [
        (ops.moe, grad, {}),
        (mxfp8, problem(device, dim=128, hidden=128, requires_grad=True, seed=5), {}),
        (fused_mxfp8, problem(device, dim=128, hidden=128, seed=6), {}),
        (deterministic, problem(device, requires_grad=True, seed=3), {}),
        (fused, problem(device, seed=4), {}),
        (gpt_oss, problem(device, requires_grad=True, seed=7), {}),
        (relu2, not_gated, {}),
        (presorted, problem(device, requires_grad=True, seed=9), {}),
        (with_lora, frozen_base, {}),
    ]
