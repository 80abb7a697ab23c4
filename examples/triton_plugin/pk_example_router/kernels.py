"""The router's Triton functions: one program per token row (a row of N_EXPERTS logits fits in registers).

Forward, per token: scores s = sigmoid(x) or softmax(x) in fp32; the selection score b = s + bias (the
auxiliary-loss-free bias correction: it moves which experts win, never the weights); each of N_GROUPS groups of experts
is scored by the sum of its two best b (its best alone for groups of one); the TOPK_GROUPS best groups stay; the TOP_K
best b among their experts are the experts, in descending order; the weights are their s (not b), renormalised to sum
to 1 when RENORMALIZE, times scale. The backward gives d loss / d logits from d loss / d weights (the choice of
experts is piecewise constant: no gradient flows through it, nor to the bias).

The runtime integers are do_not_specialize, so Triton's JIT compiles these exactly as the build does ahead of time
(no specialization on an int that happens to be 1 or a multiple of 16).

Every fp32 division is tl.math.div_rn (IEEE round to nearest, as PyTorch divides): Triton's ``/`` is PTX div.full.f32
(up to 2 ulp), which put the weights' error 1.09x the PyTorch path's at 16384 tokens and up to 2.5x at one token (8
values), where the rule allows 2.0 (docs/notes/jit_kernels.md).
"""
import triton
import triton.language as tl


@triton.constexpr_function
def padded(n):
    """The power of two a block of ``n`` lanes needs (tl.arange takes powers of two)."""
    return triton.next_power_of_2(n)


@triton.jit
def scores(x, valid, SIGMOID: tl.constexpr):
    """sigmoid(x), or softmax(x) over the row, in fp32; 0 outside ``valid`` (x is -inf there)."""
    if SIGMOID:
        return tl.where(valid, tl.math.div_rn(1.0, 1.0 + tl.exp(-x)), 0.0)
    e = tl.exp(x - tl.max(x, 0))
    return tl.math.div_rn(e, tl.sum(e, 0))


@triton.jit(do_not_specialize=["stride"])
def route_forward(logits, bias, weights, experts, stride, scale, N_EXPERTS: tl.constexpr, N_GROUPS: tl.constexpr,
                  TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, padded(N_EXPERTS))
    valid = lanes < N_EXPERTS
    x = tl.load(logits + row * stride + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    s = scores(x, valid, SIGMOID)
    b = tl.where(valid, s + tl.load(bias + lanes, mask=valid, other=0.0), float("-inf"))

    group = lanes // (N_EXPERTS // N_GROUPS)
    group_lanes = tl.arange(0, padded(N_GROUPS))
    group_score = tl.full([padded(N_GROUPS)], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUPS):
        inside = tl.where(group == g, b, float("-inf"))
        best = tl.max(inside, 0)
        if N_EXPERTS // N_GROUPS > 1:
            best += tl.max(tl.where(lanes == tl.argmax(inside, 0), float("-inf"), inside), 0)
        group_score = tl.where(group_lanes == g, best, group_score)
    allowed = lanes < 0
    for _ in tl.static_range(TOPK_GROUPS):
        g = tl.argmax(group_score, 0)
        allowed = allowed | (group == g)
        group_score = tl.where(group_lanes == g, float("-inf"), group_score)

    candidates = tl.where(allowed, b, float("-inf"))
    slots = tl.arange(0, padded(TOP_K))
    picked = tl.zeros([padded(TOP_K)], tl.float32)
    chosen = tl.zeros([padded(TOP_K)], tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(candidates, 0)
        picked = tl.where(slots == k, tl.sum(tl.where(lanes == best, s, 0.0), 0), picked)
        chosen = tl.where(slots == k, best.to(tl.int64), chosen)
        candidates = tl.where(lanes == best, float("-inf"), candidates)
    if RENORMALIZE:
        picked = tl.math.div_rn(picked, tl.sum(picked, 0))
    out = slots < TOP_K
    tl.store(weights + row * TOP_K + slots, picked * scale, mask=out)
    tl.store(experts + row * TOP_K + slots, chosen, mask=out)


@triton.jit(do_not_specialize=["stride"])
def route_backward(logits, experts, grad_weights, grad_logits, stride, scale, N_EXPERTS: tl.constexpr,
                   TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, padded(N_EXPERTS))
    valid = lanes < N_EXPERTS
    x = tl.load(logits + row * stride + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    s = scores(x, valid, SIGMOID)
    slots = tl.arange(0, padded(TOP_K))
    out = slots < TOP_K
    chosen = tl.load(experts + row * TOP_K + slots, mask=out, other=-1)
    grad = tl.load(grad_weights + row * TOP_K + slots, mask=out, other=0.0) * scale
    # The chosen experts' scores and, renormalised, w_k = s_k / S: d w_k / d s_m = (delta_km - w_k) / S.
    picked = tl.zeros([padded(TOP_K)], tl.float32)
    for k in tl.static_range(TOP_K):
        at = tl.sum(tl.where(slots == k, chosen, 0), 0)
        picked = tl.where(slots == k, tl.sum(tl.where(lanes == at, s, 0.0), 0), picked)
    if RENORMALIZE:
        total = tl.sum(picked, 0)
        grad = tl.math.div_rn(grad - tl.math.div_rn(tl.sum(grad * picked, 0), total), total)
    grad_s = tl.zeros([padded(N_EXPERTS)], tl.float32)
    for k in tl.static_range(TOP_K):
        at = tl.sum(tl.where(slots == k, chosen, 0), 0)
        grad_s += tl.where(lanes == at, tl.sum(tl.where(slots == k, grad, 0.0), 0), 0.0)
    if SIGMOID:
        grad_x = grad_s * s * (1.0 - s)
    else:
        grad_x = s * (grad_s - tl.sum(grad_s * s, 0))
    tl.store(grad_logits + row * N_EXPERTS + lanes, grad_x.to(grad_logits.dtype.element_ty), mask=valid)
