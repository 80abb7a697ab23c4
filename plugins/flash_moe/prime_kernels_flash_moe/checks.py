"""The ops' argument checks in Python: the same conditions, in the same order and words, as csrc/flash_moe.h.

The fake (meta) implementations call them, so a traced call and a call that mixes a ``meta`` tensor with real ones
(which the dispatcher sends to the fake) fail exactly as the C++ ops do instead of returning uninitialised memory;
the public functions call ``require_tensors`` first, so a list, an array or None is named instead of failing deep
inside as an AttributeError.
"""
from __future__ import annotations

import math

import torch

INT32_MAX = 2**31 - 1


def require(condition, message: str) -> None:
    """RuntimeError(message) unless ``condition`` (a bool or a traced SymBool), as TORCH_CHECK."""
    torch._check(condition, lambda: message)


def require_tensors(op: str, **operands) -> None:
    """TypeError naming the first operand that is not a torch.Tensor (``None`` allowed only where the name ends in
    '?': pass ``**{"bias?": bias}``)."""
    for name, value in operands.items():
        optional = name.endswith("?")
        if optional and value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name.rstrip('?')} must be a torch.Tensor, got {type(value).__name__}")


def require_int(op: str, **values) -> None:
    """TypeError naming the first value that is not an int (bool excluded)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")


def require_bool(op: str, **values) -> None:
    """TypeError naming the first flag that is not a bool (a tensor or a string is not a flag)."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def _name(dtype: torch.dtype) -> str:
    """The name TORCH_CHECK prints for a scalar type (c10's ScalarType names)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
            torch.bool: "Bool", torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e8m0fnu: "Float8_e8m0fnu",
            torch.float8_e5m2: "Float8_e5m2"}.get(dtype, str(dtype).removeprefix("torch."))


def as_bits_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mxfp8 ops take e4m3 / e8m0 tensors or their uint8 bytes."""
    return t.view(dtype) if t.dtype == torch.uint8 else t


def contract_reason(dim, hidden, constants, mxfp8: bool = False) -> str | None:
    if dim < 1 or hidden < 1:
        return f"flash_moe needs positive dim and hidden_dim, got dim={dim}, hidden_dim={hidden}"
    dim_align = constants["MXFP8_ALIGN"] if mxfp8 else constants["DIM_ALIGN"]
    hidden_align = constants["MXFP8_ALIGN"] if mxfp8 else constants["HIDDEN_ALIGN"]
    path = " for mxfp8" if mxfp8 else ""
    if dim % dim_align:
        return f"flash_moe needs dim (x's last dimension) to be a multiple of {dim_align}{path}, got {dim}"
    if hidden % hidden_align:
        return f"flash_moe needs hidden_dim to be a multiple of {hidden_align}{path}, got {hidden}"
    return None


def check_align_args(topk_ids, num_experts, block_m, bpc, expert_start, num_local_experts, block_align, constants):
    """check_align_args: returns (local experts, padded length)."""
    op = "moe_align"
    require(topk_ids.dtype in (torch.int32, torch.int64), f"{op}: topk_ids must be int32 or int64, got "
                                                  f"{_name(topk_ids.dtype)}")
    require(topk_ids.dim() == 2, f"{op}: topk_ids must be 2-D (M, top_k), got shape {_shape(topk_ids)}")
    require(num_experts >= 1, f"{op}: num_experts must be positive, got {num_experts}")
    require(block_m >= 1, f"{op}: block_m must be positive, got {block_m}")
    require(bpc >= 1, f"{op}: bpc (blocks per expert pad unit) must be positive, got {bpc}")
    require(block_align >= 1, f"{op}: block_align (blocks an expert's start is aligned to) must be positive, got "
                              f"{block_align}")
    require(0 <= expert_start < num_experts,
            f"{op}: expert_start must be in [0, num_experts={num_experts}), got {expert_start}")
    local = num_experts - expert_start if num_local_experts < 0 else num_local_experts
    require(local >= 1 and expert_start + local <= num_experts,
            f"{op}: num_local_experts must be in [1, {num_experts - expert_start}] (num_experts - expert_start), got "
            f"{local}")
    max_experts = constants["MAX_EXPERTS"]
    require(local <= max_experts, f"{op}: at most {max_experts} local experts, got num_local_experts={local} "
                                  f"(num_experts - expert_start when not given)")
    require(expert_start + local - 1 <= INT32_MAX,
            f"{op}: the local experts [expert_start, expert_start + num_local_experts) must be int32 ids, got "
            f"expert_start={expert_start}, num_local_experts={local}")
    slots = topk_ids.numel()
    require(slots < INT32_MAX, f"{op}: M * top_k must fit in int32, got {slots}")
    require(block_m <= INT32_MAX // bpc,
            f"{op}: block_m * bpc (the pad unit) must fit in int32, got block_m={block_m}, bpc={bpc}")
    pad = block_m * bpc
    require(block_align <= INT32_MAX // block_m,
            f"{op}: block_m * block_align must fit in int32, got block_m={block_m}, block_align={block_align}")
    max_padded = (slots + local * (pad - 1) + pad - 1) // pad * pad + local * (block_align - 1) * block_m
    require(max_padded < INT32_MAX,
            f"{op}: the padded length (sorted_token_ids) must fit in int32, got {max_padded} for M * top_k={slots}, "
            f"{local} local experts, block_m * bpc={pad}, block_align={block_align}")
    return local, max_padded


ACTIVATIONS = ("swiglu", "gpt_oss", "relu2")


def parse_activation(op, activation, alpha, limit):
    """parse_activation: returns whether the activation is gated (has an up projection)."""
    require(activation in ACTIVATIONS,
            f"{op}: activation must be 'swiglu', 'gpt_oss' or 'relu2', got '{activation}'")
    require(activation != "gpt_oss" or (math.isfinite(alpha) and math.isfinite(limit) and limit > 0),
            f"{op}: activation 'gpt_oss' needs a finite alpha and a finite positive limit, got alpha={alpha}, "
            f"limit={limit}")
    return activation != "relu2"


def check_gated(op, gated, has_up, up_name):
    require(has_up == gated,
            f"{op}: {up_name} " + ("is required for a gated activation" if gated else
                                   "must be None for activation 'relu2' (not gated: w1 alone)")
            + f", got {'a tensor' if has_up else 'None'}")


def check_bias(op, name, b, E, n, x):
    if b is None:
        return
    require(b.dtype == torch.bfloat16, f"{op}: {name} must be bfloat16, got {_name(b.dtype)}")
    require(b.dim() == 2 and b.shape[0] == E and b.shape[1] == n,
            f"{op}: {name} must have shape (E, {n}) = ({E}, {n}), got {_shape(b)}")
    require(b.device == x.device, f"{op}: {name} must be on x's device {x.device}, got {b.device}")


def check_experts(op, x, w1, w3, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k,
                  block_m, num_experts, gated, b_gate, b_up, b2, constants):
    """check_experts: returns (M, dim, hidden, E)."""
    check_gated(op, gated, w3 is not None, "w3")
    shape = check_moe_args(op, x, w1, w1 if w3 is None else w3, w2, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, topk_weights, top_k, block_m, "w1/w3", constants)
    check_global_experts(op, num_experts, shape[3])
    _, dim, hidden, E = shape
    check_bias(op, "b_gate", b_gate, E, hidden, x)
    require(gated or b_up is None, f"{op}: b_up must be None for activation 'relu2' (not gated)")
    check_bias(op, "b_up", b_up, E, hidden, x)
    check_bias(op, "b2", b2, E, dim, x)
    return shape


def split_gate_up(op, w):
    require(w.dim() == 3 and w.shape[1] % 2 == 0,
            f"{op}: w must be 3-D (E, 2 * hidden, dim) with gate rows [0, hidden) and up rows [hidden, 2 * hidden), "
            f"got shape {_shape(w)}")
    hidden = w.shape[1] // 2
    return w.narrow(1, 0, hidden), w.narrow(1, hidden, hidden)


def check_moe_args(op, x, gate, up, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k,
                   block_m, w_name, constants, dtype=torch.bfloat16, x_name="x"):
    """check_moe_args: returns (M, dim, hidden, E)."""
    mxfp8 = dtype == torch.float8_e4m3fn
    dname = "float8_e4m3fn" if mxfp8 else "bfloat16"
    require(x.dtype == dtype, f"{op}: x must be {dname}, got {_name(x.dtype)}")
    require(x.dim() == 2, f"{op}: x must be 2-D (M, dim), got shape {_shape(x)}")
    require(gate.dtype == dtype and up.dtype == dtype,
            f"{op}: {w_name} must be {dname}, got {_name(gate.dtype)} / {_name(up.dtype)}")
    require(gate.dim() == 3 and up.dim() == 3,
            f"{op}: {w_name} must be 3-D expert weights, got shapes {_shape(gate)} / {_shape(up)}")
    M, dim = x.shape
    E, hidden = gate.shape[0], gate.shape[1]
    require(up.shape == gate.shape, f"{op}: the gate and up weights must have one shape (E, hidden, dim), got "
                                    f"{_shape(gate)} and {_shape(up)} ({w_name})")
    require(gate.shape[2] == dim,
            f"{op}: {w_name}'s last dimension must be dim={dim} (x's last dimension), got {gate.shape[2]}")
    if w2 is not None:
        require(w2.dtype == dtype, f"{op}: w2 must be {dname}, got {_name(w2.dtype)}")
        require(w2.dim() == 3, f"{op}: w2 must be 3-D (E, dim, hidden), got shape {_shape(w2)}")
        require(w2.shape[0] == E, f"{op}: w2 must have E={E} experts ({w_name}'s first dimension), got {w2.shape[0]}")
        require(w2.shape[1] == dim and w2.shape[2] == hidden,
                f"{op}: w2 must have shape (E, dim, hidden) = ({E}, {dim}, {hidden}), got {_shape(w2)}")
        require(w2.device == x.device, f"{op}: w2 must be on {x_name}'s device {x.device}, got {w2.device}")
    reason = contract_reason(dim, hidden, constants, mxfp8)
    require(reason is None, f"{op}: {reason} (hidden_dim: {w_name}'s second dimension)")
    require(top_k >= 1, f"{op}: top_k must be positive, got {top_k}")
    block = constants["BLOCK_M"]
    require(block_m == block, f"{op}: block_m must be BLOCK_M={block} (the tile the kernels are compiled for; align "
                              f"with the same block_m), got {block_m}")
    require(sorted_token_ids.dtype == torch.int32 and sorted_token_ids.dim() == 1,
            f"{op}: sorted_token_ids must be a 1-D int32 tensor, got {_name(sorted_token_ids.dtype)} of shape "
            f"{_shape(sorted_token_ids)}")
    require(sorted_token_ids.numel() % block_m == 0,
            f"{op}: sorted_token_ids' length must be a multiple of block_m={block_m}, got {sorted_token_ids.numel()}")
    blocks = sorted_token_ids.numel() // block_m
    require(expert_ids.dtype == torch.int32 and expert_ids.dim() == 1 and expert_ids.numel() == blocks,
            f"{op}: expert_ids must be a 1-D int32 tensor of {blocks} blocks (len(sorted_token_ids) / block_m), got "
            f"{_name(expert_ids.dtype)} of shape {_shape(expert_ids)}")
    require(num_tokens_post_padded.dtype == torch.int32 and num_tokens_post_padded.numel() == 1,
            f"{op}: num_tokens_post_padded must be an int32 tensor of one element, got "
            f"{_name(num_tokens_post_padded.dtype)} of shape {_shape(num_tokens_post_padded)}")
    require(M * top_k < INT32_MAX, f"{op}: M * top_k must fit in int32, got {M * top_k}")
    if topk_weights is not None:
        require(topk_weights.dtype == torch.float32, f"{op}: topk_weights must be float32, got {_name(topk_weights.dtype)}")
        require(topk_weights.dim() == 2 and topk_weights.shape[0] == M and topk_weights.shape[1] == top_k,
                f"{op}: topk_weights must have shape (M, top_k) = ({M}, {top_k}), got {_shape(topk_weights)}")
    for name, t in ((w_name, gate), (w_name, up), ("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        require(t.device == x.device, f"{op}: {name} must be on {x_name}'s device {x.device}, got {t.device}")
    if topk_weights is not None:
        require(topk_weights.device == x.device,
                f"{op}: topk_weights must be on {x_name}'s device {x.device}, got {topk_weights.device}")
    return M, dim, hidden, E


def check_mx_scales(op, x, x_scales, w_scales, w2_scales, shape, constants):
    M, dim, hidden, E = shape
    for name, t in (("x_scales", x_scales), ("w_scales", w_scales), ("w2_scales", w2_scales)):
        require(t.dtype == torch.float8_e8m0fnu, f"{op}: {name} must be float8_e8m0fnu, got {_name(t.dtype)}")
        require(t.device == x.device, f"{op}: {name} must be on x's device {x.device}, got {t.device}")
    sb, align = constants["MXFP8_SCALE_BLOCK"], constants["MXFP8_ALIGN"]
    g = align // sb
    require(x_scales.dim() == 2 and x_scales.shape[0] == M and x_scales.shape[1] == dim // sb,
            f"{op}: x_scales must have shape (M, dim / {sb}) = ({M}, {dim // sb}), got {_shape(x_scales)}")
    require(list(w_scales.shape) == [E, dim // align, 2 * hidden, g],
            f"{op}: w_scales must be pack_scales_blocked's layout (E, dim / {align}, 2 * hidden, {g}) = "
            f"({E}, {dim // align}, {2 * hidden}, {g}), got {_shape(w_scales)}")
    require(list(w2_scales.shape) == [E, hidden // align, dim, g],
            f"{op}: w2_scales must be pack_scales_blocked's layout (E, hidden / {align}, dim, {g}) = "
            f"({E}, {hidden // align}, {dim}, {g}), got {_shape(w2_scales)}")


def check_out(op, out, shape, x):
    M, dim = shape[0], shape[1]
    require(out.dtype == torch.bfloat16, f"{op}: out must be bfloat16, got {_name(out.dtype)}")
    require(out.dim() == 2 and out.shape[0] == M and out.shape[1] == dim,
            f"{op}: out must have shape (M, dim) = ({M}, {dim}), got {_shape(out)}")
    require(out.is_contiguous(), f"{op}: out must be contiguous (it is written in place), got strides "
                                 f"{list(out.stride())}")
    require(out.device == x.device, f"{op}: out must be on x's device {x.device}, got {out.device}")


def check_mxfp8_moe_args(op, x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                         num_tokens_post_padded, topk_weights, top_k, block_m, constants):
    """The mxfp8 ops' checks (mxfp8_slot_outputs_cpu's order): returns (M, dim, hidden, E)."""
    x, w, w2 = (as_bits_of(t, torch.float8_e4m3fn) for t in (x, w, w2))
    x_scales, w_scales, w2_scales = (as_bits_of(t, torch.float8_e8m0fnu) for t in (x_scales, w_scales, w2_scales))
    gate, up = split_gate_up(op, w)
    shape = check_moe_args(op, x, gate, up, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
                           top_k, block_m, "w", constants, torch.float8_e4m3fn)
    check_mx_scales(op, x, x_scales, w_scales, w2_scales, shape, constants)
    return shape


def check_quantize_args(t, block):
    op = "quantize_mxfp8"
    require(t.dtype in (torch.float32, torch.bfloat16, torch.float16),
            f"{op}: t must be float32, bfloat16 or float16, got {_name(t.dtype)}")
    require(t.dim() >= 1, f"{op}: t must have at least one dimension")
    require(block >= 1, f"{op}: block must be positive, got {block}")
    require(t.shape[-1] % block == 0, f"{op}: the last dimension must be a multiple of block={block}, got "
                                      f"{t.shape[-1]}")


def check_share_args(data, scales, constants):
    op = "share_exponents_mxfp8"
    data, scales = as_bits_of(data, torch.float8_e4m3fn), as_bits_of(scales, torch.float8_e8m0fnu)
    align, sb = constants["MXFP8_ALIGN"], constants["MXFP8_SCALE_BLOCK"]
    require(data.dtype == torch.float8_e4m3fn, f"{op}: data must be float8_e4m3fn, got {_name(data.dtype)}")
    require(scales.dtype == torch.float8_e8m0fnu, f"{op}: scales must be float8_e8m0fnu, got {_name(scales.dtype)}")
    require(data.dim() >= 1 and data.shape[-1] % align == 0,
            f"{op}: data's last dimension must be a multiple of MXFP8_ALIGN={align}, got shape {_shape(data)}")
    want = [*data.shape[:-1], data.shape[-1] // sb]
    require(list(scales.shape) == want, f"{op}: scales must have shape (..., K / {sb}) = {want}, got {_shape(scales)}")
    require(scales.device == data.device, f"{op}: scales must be on data's device {data.device}, got {scales.device}")


def check_swiglu_backward_args(gate_up, grad_h, row_weights, valid):
    """check_swiglu_backward_args: returns hidden."""
    op = "swiglu_backward"
    require(gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
            f"{op}: gate_up must be a 2-D bfloat16 tensor (S, 2 * hidden), got {_name(gate_up.dtype)} of shape "
            f"{_shape(gate_up)}")
    rows, hidden = gate_up.shape[0], gate_up.shape[1] // 2
    require(rows < INT32_MAX, f"{op}: gate_up must have at most 2^31 - 2 rows, got {rows}")
    require(grad_h.dtype == torch.bfloat16 and grad_h.dim() == 2 and grad_h.shape[0] == rows
            and grad_h.shape[1] == hidden,
            f"{op}: grad_h must be bfloat16 of shape (S, hidden) = ({rows}, {hidden}), got {_name(grad_h.dtype)} of shape "
            f"{_shape(grad_h)}")
    require(row_weights.dtype == torch.float32 and row_weights.dim() == 1 and row_weights.shape[0] == rows,
            f"{op}: row_weights must be float32 of shape (S,) = ({rows},), got {_name(row_weights.dtype)} of shape "
            f"{_shape(row_weights)}")
    require(valid.dtype == torch.bool and valid.dim() == 1 and valid.shape[0] == rows,
            f"{op}: valid must be bool of shape (S,) = ({rows},), got {_name(valid.dtype)} of shape {_shape(valid)}")
    for name, t in (("grad_h", grad_h), ("row_weights", row_weights), ("valid", valid)):
        require(t.device == gate_up.device, f"{op}: {name} must be on gate_up's device {gate_up.device}, got {t.device}")
    return hidden


def check_global_experts(op, num_experts, local_experts):
    """set_global_experts: the ops' num_experts (the global expert count for the launch rules) is -1 or at least the
    local count (and fits int32, as moe()'s num_experts)."""
    require(num_experts == -1 or local_experts <= num_experts <= INT32_MAX,
            f"{op}: num_experts (the global expert count) must be -1 or in [E, 2^31 - 1] (E={local_experts} local "
            f"experts), got {num_experts}")


def check_grad_gate_up_args(op, grad_out, w2, gate_up, sorted_token_ids, expert_ids, num_tokens_post_padded,
                            topk_weights, top_k, block_m, constants, gated=True):
    """check_grad_gate_up_args: returns (M, dim, hidden, E)."""
    require(w2.dtype == torch.bfloat16, f"{op}: w2 must be bfloat16, got {_name(w2.dtype)}")
    require(w2.dim() == 3, f"{op}: w2 must be 3-D (E, dim, hidden), got shape {_shape(w2)}")
    require(grad_out.dtype == torch.bfloat16, f"{op}: grad_out must be bfloat16, got {_name(grad_out.dtype)}")
    require(grad_out.dim() == 2 and grad_out.shape[1] == w2.shape[1],
            f"{op}: grad_out must be 2-D (M, dim) with dim = w2's second dimension {w2.shape[1]}, got shape "
            f"{_shape(grad_out)}")
    w2_t = w2.transpose(1, 2)
    shape = check_moe_args(op, grad_out, w2_t, w2_t, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                           topk_weights, top_k, block_m, "w2 (as (E, hidden, dim))", constants,
                           x_name="grad_out")
    M, _, hidden, _ = shape
    width = 2 * hidden if gated else hidden  # g | u, or g alone (relu2)
    require(gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[0] == M * top_k
            and gate_up.shape[1] == width,
            f"{op}: gate_up must be bfloat16 of shape (M * top_k, {'2 * hidden' if gated else 'hidden'}) = "
            f"({M * top_k}, {width}), got {_name(gate_up.dtype)} of shape {_shape(gate_up)}")
    require(gate_up.device == grad_out.device,
            f"{op}: gate_up must be on grad_out's device {grad_out.device}, got {gate_up.device}")
    return shape


def check_grad_x_halves(op, grad_up, w3):
    require((grad_up is None) == (w3 is None),
            f"{op}: grad_up and w3 must both be tensors (a gated activation) or both be None (relu2), got grad_up "
            f"{'None' if grad_up is None else 'a tensor'} and w3 {'None' if w3 is None else 'a tensor'}")


def check_grad_x_args(op, grad_gate, grad_up, w1, w3, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                      block_m, constants):
    """check_grad_x_args: returns (M, dim, hidden, E)."""
    require(top_k >= 1, f"{op}: top_k must be positive, got {top_k}")
    require(w1.dim() == 3, f"{op}: w1/w3 must be 3-D expert weights (E, hidden, dim), got shape {_shape(w1)}")
    require(grad_gate.dtype == torch.bfloat16 and grad_gate.dim() == 2 and grad_gate.shape[0] % top_k == 0
            and grad_gate.shape[1] == w1.shape[1],
            f"{op}: grad_gate must be bfloat16 of shape (M * top_k, hidden) with hidden = w1's second dimension "
            f"{w1.shape[1]}, got {_name(grad_gate.dtype)} of shape {_shape(grad_gate)}")
    require(grad_up.dtype == torch.bfloat16 and grad_up.shape == grad_gate.shape,
            f"{op}: grad_up must be bfloat16 of grad_gate's shape {_shape(grad_gate)}, got {_name(grad_up.dtype)} of "
            f"shape {_shape(grad_up)}")
    require(grad_up.device == grad_gate.device,
            f"{op}: grad_up must be on grad_gate's device {grad_gate.device}, got {grad_up.device}")
    x = grad_gate.new_empty(1, 1).expand(grad_gate.shape[0] // top_k, w1.shape[2])
    return check_moe_args(op, x, w1, w3, None, sorted_token_ids, expert_ids, num_tokens_post_padded, None, top_k,
                          block_m, "w1/w3", constants, x_name="grad_gate")


def check_grad_weight_args(rows, source, row_token, expert_ends):
    """check_grad_weight_args: returns (S, N, T, K, E)."""
    op = "moe_grad_weight"
    require(rows.dtype == torch.bfloat16 and rows.dim() == 2,
            f"{op}: rows must be a 2-D bfloat16 tensor (S, N), got {_name(rows.dtype)} of shape {_shape(rows)}")
    require(source.dtype == torch.bfloat16 and source.dim() == 2,
            f"{op}: source must be a 2-D bfloat16 tensor (T, K), got {_name(source.dtype)} of shape {_shape(source)}")
    (S, N), (T, K), E = rows.shape, source.shape, expert_ends.numel()
    require(N % 8 == 0 and K % 8 == 0, f"{op}: rows' and source's widths must be multiples of 8, got N={N}, K={K}")
    require(S <= INT32_MAX and T <= INT32_MAX and N <= INT32_MAX and K <= INT32_MAX,
            f"{op}: rows and source must have fewer than 2^31 rows and columns, got {_shape(rows)} and "
            f"{_shape(source)}")
    require(row_token.dtype == torch.int32 and row_token.dim() == 1 and row_token.shape[0] == S,
            f"{op}: row_token must be a 1-D int32 tensor of S={S} entries (rows' first dimension), got "
            f"{_name(row_token.dtype)} of shape {_shape(row_token)}")
    require(expert_ends.dtype == torch.int32 and expert_ends.dim() == 1 and E >= 1,
            f"{op}: expert_ends must be a 1-D int32 tensor with one entry per expert, got "
            f"{_name(expert_ends.dtype)} of shape {_shape(expert_ends)}")
    for name, t in (("source", source), ("row_token", row_token), ("expert_ends", expert_ends)):
        require(t.device == rows.device, f"{op}: {name} must be on rows' device {rows.device}, got {t.device}")
    return S, N, T, K, E


def check_lora_pair(op, a_name, b_name, a, b, n, E, n_in, n_out, x, x_name, constants):
    """check_lora_pair: returns the rank (0 when the projection has no adapter)."""
    require((a is None) == (b is None),
            f"{op}: {a_name} and {b_name} must both be tensors (the projection has an adapter) or both None, got "
            f"{a_name} {'None' if a is None else 'a tensor'} and {b_name} {'None' if b is None else 'a tensor'}")
    if a is None:
        return 0
    for name, t in ((a_name, a), (b_name, b)):
        require(t.dtype == torch.bfloat16, f"{op}: {name} must be bfloat16 (the weights' dtype), got {_name(t.dtype)}")
        require(t.device == x.device, f"{op}: {name} must be on {x_name}'s device {x.device}, got {t.device}")
    require(a.dim() == 4 and a.shape[0] == n and a.shape[1] == E and a.shape[3] == n_in,
            f"{op}: {a_name} must have shape (n_adapters, E, r, in) = ({n}, {E}, r, {n_in}), got {_shape(a)}")
    r = a.shape[2]
    align = constants["LORA_RANK_ALIGN"]
    require(r >= 1 and r % align == 0, f"{op}: {a_name}'s rank (third dimension) must be a positive multiple of "
                                        f"LORA_RANK_ALIGN={align}, got {r}")
    require(b.dim() == 4 and b.shape[0] == n and b.shape[1] == E and b.shape[2] == n_out and b.shape[3] == r,
            f"{op}: {b_name} must have shape (n_adapters, E, out, r) = ({n}, {E}, {n_out}, {r}) (r: {a_name}'s rank), "
            f"got {_shape(b)}")
    return r


def check_lora(op, x, scaling, E, dim, hidden, gated, a_gate, b_gate, a_up, b_up, a_down, b_down, constants,
               x_name="x"):
    """check_lora: returns (n_adapters, gate rank, up rank, down rank)."""
    require(scaling.dtype == torch.float32 and scaling.dim() == 1 and scaling.shape[0] >= 1,
            f"{op}: scaling must be a 1-D float32 tensor of one factor per adapter, got {_name(scaling.dtype)} of "
            f"shape {_shape(scaling)}")
    require(scaling.device == x.device, f"{op}: scaling must be on {x_name}'s device {x.device}, got {scaling.device}")
    n = scaling.shape[0]
    require(E * n <= INT32_MAX, f"{op}: E * n_adapters (the aligned groups) must fit in int32, got E={E}, "
                                f"n_adapters={n}")
    r_gate = check_lora_pair(op, "a_gate", "b_gate", a_gate, b_gate, n, E, dim, hidden, x, x_name, constants)
    require(gated or a_up is None, f"{op}: a_up and b_up must be None without w3 (activation 'relu2': no up "
                                   f"projection), got a tensor")
    r_up = check_lora_pair(op, "a_up", "b_up", a_up, b_up, n, E, dim, hidden, x, x_name, constants)
    r_down = check_lora_pair(op, "a_down", "b_down", a_down, b_down, n, E, hidden, dim, x, x_name, constants)
    return n, r_gate, r_up, r_down
