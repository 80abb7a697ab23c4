"""Vocabulary-parallel logp and entropy (issue 6): the logits (``ops.logp_entropy``) or the lm_head
(``linear_ops.linear_logp_entropy``) sharded over the vocabulary across the ranks of a torch.distributed group.

Each rank runs the registered local op on its shard; the ranks then combine per-token float64 statistics, never
[N, V] tensors. With (lse_r, spz_r) = the local op's ``stats`` (logsumexp and sum p z over rank r's columns):

    M = max_r lse_r (all_reduce MAX);  s = sum_r exp(lse_r - M);  lse = M + log s
    sum_pz = sum_r exp(lse_r - M) spz_r / s;  z_y = the label's logit, from the rank that owns it (one all_reduce SUM)
    logp = z_y - lse;  entropy = lse - sum_pz;  ignored tokens 0.

Tokens whose label another rank owns run the local forward op with an in-range dummy label (token i -> local column
i mod V_local); the op's logp is not used. In the backward the logits version removes the onehot term the dummy
adds, exactly (``_LogitsFn.backward``); the linear version passes the label V_local instead, which the linear
backward op turns into no onehot term at all (``_LinearFn.backward``). The backward runs the local backward
op with the global (lse, sum_pz), so grad_logits / grad_weight / grad_bias need no collective; grad_hidden of the
linear version is a sum over all vocab shards, hence one all_reduce SUM of [N, H] (fp32).

Every call first runs ``_agree``: one all_gather of a 15-int64 row per rank and one host read, so that ranks that
disagree on N, H, the temperature (a tensor's values by checksum), the labels or the shard layout, or that failed
their own argument checks, all raise the same kind of error instead of hanging in a later collective. Details:
docs/notes/vocab_parallel.md.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from prime_kernels_core.contracts import UnsupportedShapeError

from . import linear_contract, reference
from .inputs import check_linear_transform, flatten_linear, flatten_logits

_ops = torch.ops.fused_logp
_LOCAL_IGNORE = -1  # local label of ignored tokens; every other local label is in [0, V_local)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_I64_MAX = 2**63 - 1
# The int64 row each rank contributes to the all_gather of _agree.
_FIELDS = ("error", "num_tokens", "local_vocab", "vocab_start", "hidden_size", "temperature_kind",
           "temperature_bits", "ignore_index", "return_entropy", "grad_hidden", "labels_checksum", "label_min",
           "label_max", "temperature_checksum", "batch_invariant", "softcap_bits", "logit_scale_bits")
_F = {name: i for i, name in enumerate(_FIELDS)}


# ---- the per-call agreement ------------------------------------------------------------------------------------------
def _temperature_code(temperature) -> tuple[int, int]:
    """(kind, bits): kind -1 = a float (bits = its float64 bit pattern), -2 = a 0-d tensor, else per-token numel (a
    tensor's values enter the row through _checksum, on the device)."""
    if isinstance(temperature, torch.Tensor):
        return (-2, 0) if temperature.dim() == 0 else (temperature.numel(), 0)
    return -1, struct.unpack("<q", struct.pack("<d", float(temperature)))[0]


def _float_bits(value) -> int:
    """A float's float64 bit pattern as an int64 (None: -1, which no positive float has)."""
    return -1 if value is None else struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _describe_float_bits(bits: int) -> str:
    return "None" if bits == -1 else repr(struct.unpack("<d", struct.pack("<q", bits))[0])


def _describe_temperature(kind: int, bits: int) -> str:
    if kind == -1:
        return f"the float {struct.unpack('<d', struct.pack('<q', bits))[0]!r}"
    return "a 0-d tensor" if kind == -2 else f"a per-token tensor of {kind} elements"


def _checksum(values: torch.Tensor) -> torch.Tensor:
    """0-d int64 on values' device, position-weighted so that a permutation changes it."""
    flat = values.reshape(-1)
    return (flat * (torch.arange(flat.numel(), device=flat.device) % 127 + 1)).sum()


def _agree(group, device, error, n, local_vocab, vocab_start, hidden_size, temperature, ignore_index, return_entropy,
           grad_hidden, labels, batch_invariant=False, softcap=None, logit_scale=1.0):
    """One all_gather of a small int64 row per rank, then one host read; every rank checks the same table.

    Returns (this rank's vocab_start, global vocab size). Raises on every rank when any rank failed its local argument
    checks (that rank re-raises its own error) or when the ranks disagree, naming the values."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if error is None:
        kind, bits = _temperature_code(temperature)
        host = [0, n, local_vocab, -1 if vocab_start is None else vocab_start, hidden_size, kind, bits, ignore_index,
                int(return_entropy), int(grad_hidden)]
        lab = labels.long()
        valid = lab != ignore_index
        if isinstance(temperature, torch.Tensor):  # its float32 bits, as the ops read it
            temperature_checksum = _checksum(temperature.detach().to(torch.float32).view(torch.int32).long())
        else:
            temperature_checksum = lab.new_zeros(())
        dev = torch.stack([
            _checksum(lab),
            torch.cat([torch.where(valid, lab, _I64_MAX), lab.new_full((1,), _I64_MAX)]).min(),
            torch.cat([torch.where(valid, lab, -1), lab.new_full((1,), -1)]).max(),
            temperature_checksum,
        ])
        row = torch.cat([torch.tensor(host, dtype=torch.int64, device=device), dev,
                         torch.tensor([int(batch_invariant), _float_bits(softcap), _float_bits(logit_scale)],
                                      dtype=torch.int64, device=device)])
    else:
        row = torch.zeros(len(_FIELDS), dtype=torch.int64, device=device)
        row[_F["error"]] = 1
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows).tolist()  # the one host read (a stream sync on CUDA)

    if error is not None:
        raise error
    failed = [r for r in range(world) if table[r][_F["error"]]]
    if failed:
        raise RuntimeError(f"vocab_parallel (rank {rank}): rank(s) {failed} of the group failed their argument checks "
                           f"(the error is raised there); every rank stops here instead of waiting in a collective")

    def col(name):
        return [table[r][_F[name]] for r in range(world)]

    def same(name, what, show=None):
        values = col(name)
        show = show or (lambda r: str(values[r]))
        other = next((r for r in range(world) if values[r] != values[rank]), None)
        if other is not None:
            raise ValueError(f"vocab_parallel: ranks disagree on {what}: rank {rank} has {show(rank)}, rank {other} "
                             f"has {show(other)} (every rank raises; no collective is left pending)")

    same("num_tokens", "the number of tokens N")
    same("hidden_size", "the hidden size H")
    same("temperature_kind", "the temperature",
         lambda r: _describe_temperature(table[r][_F["temperature_kind"]], table[r][_F["temperature_bits"]]))
    same("temperature_bits", "the temperature", lambda r: _describe_temperature(-1, table[r][_F["temperature_bits"]]))
    same("temperature_checksum", "the temperature tensor's values (position-weighted checksum of the float32 bits)")
    same("ignore_index", "ignore_index")
    same("return_entropy", "return_entropy", lambda r: str(bool(table[r][_F["return_entropy"]])))
    same("grad_hidden", "whether hidden requires grad (the backward all-reduces grad_hidden)",
         lambda r: str(bool(table[r][_F["grad_hidden"]])))
    same("labels_checksum", "the labels (position-weighted checksum)")
    same("batch_invariant", "batch_invariant (the invariant mode gathers partials instead of all-reducing them)",
         lambda r: str(bool(table[r][_F["batch_invariant"]])))
    same("softcap_bits", "softcap", lambda r: _describe_float_bits(table[r][_F["softcap_bits"]]))
    same("logit_scale_bits", "logit_scale", lambda r: _describe_float_bits(table[r][_F["logit_scale_bits"]]))

    sizes, starts = col("local_vocab"), col("vocab_start")
    total = sum(sizes)
    if all(s == -1 for s in starts):
        start = sum(sizes[:rank])
    elif any(s == -1 for s in starts):
        given = [r for r in range(world) if starts[r] != -1]
        raise ValueError(f"vocab_parallel: vocab_start must be given on every rank or on none; ranks {given} of "
                         f"{world} gave it")
    else:
        order = sorted(range(world), key=lambda r: starts[r])
        expect = 0
        for r in order:
            if starts[r] != expect:
                layout = ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in order)
                raise ValueError(f"vocab_parallel: the shards must tile [0, {total}) without gaps or overlaps; got "
                                 f"{layout}")
            expect += sizes[r]
        start = starts[rank]
    lo, hi = table[rank][_F["label_min"]], table[rank][_F["label_max"]]
    if lo < 0 or hi >= total:
        bad = labels.long()
        bad = ((bad != ignore_index) & ((bad < 0) | (bad >= total))).nonzero()[0, 0].item()
        value = labels.reshape(-1)[bad].item()
        raise ValueError(f"vocab_parallel: labels[{bad}] = {value} is out of range: labels must be in [0, {total}) "
                         f"(the global vocabulary) or equal ignore_index ({ignore_index})")
    return start, total


def _default_device(group):
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_labels(labels1, ignore_index, vocab_start, local_vocab):
    """(local labels, owned, not owned but valid): owned tokens get label - vocab_start, ignored ones _LOCAL_IGNORE,
    the others the dummy column i mod local_vocab."""
    lab = labels1.long()
    valid = lab != ignore_index
    local = lab - vocab_start
    owned = valid & (local >= 0) & (local < local_vocab)
    dummy = torch.arange(lab.numel(), device=lab.device) % local_vocab
    local = torch.where(owned, local, torch.where(valid, dummy, _LOCAL_IGNORE))
    return local, owned, valid & ~owned


def _token_temperature(temperature: float, token_temperature, n, device):
    """Float64 [N] temperature of each token, as the ops compute it (T * token_temperature[i] in double)."""
    if token_temperature is None:
        return torch.full((n,), float(temperature), dtype=torch.float64, device=device)
    return token_temperature.double() * float(temperature)


# ---- the combine: [N]-sized float64 collectives --------------------------------------------------------------------
def _sum_over_ranks(t, group, batch_invariant):
    """Sum of ``t`` over the group's ranks, in place. batch_invariant: gathered and added in rank order (a collective's
    own summation order may depend on the message size, i.e. on N, for more than two ranks)."""
    if not batch_invariant:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    t.copy_(parts[0])
    for part in parts[1:]:
        t.add_(part)
    return t


def _combine(lse_l, spz_l, zy_l, owned, valid, want_entropy, group, batch_invariant=False):
    """Global (lse, sum_pz, logp fp32, entropy fp32 or empty) from the local float64 statistics; two collectives (the
    max is exact in any order)."""
    m = lse_l.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    zero = torch.zeros_like(m)
    m = torch.where(torch.isfinite(m), m, zero)  # all shards -inf (or NaN): keep exp finite, NaN still propagates
    w = torch.exp(lse_l - m)
    cols = [w, torch.where(owned, zy_l, zero)]
    if want_entropy:  # a shard of only -inf logits has w = 0 and spz NaN: it contributes nothing
        cols.append(torch.where(w == 0, zero, w * spz_l))
    parts = _sum_over_ranks(torch.stack(cols, 1), group, batch_invariant)
    s = parts[:, 0]
    lse = m + torch.log(s)
    logp = torch.where(valid, parts[:, 1] - lse, zero).float()
    if want_entropy:
        spz = parts[:, 2] / s
        entropy = torch.where(valid, lse - spz, zero).float()
    else:
        spz = zero
        entropy = lse.new_empty((0,), dtype=torch.float32)
    return lse, spz, logp, entropy


def _round_like_op(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> dtype as the CPU ops round (fp32 round-to-odd first for 16-bit types: no double rounding)."""
    f = v.float()
    if dtype == torch.float32:
        return f
    inexact = (f.double() != v) & torch.isfinite(f) & ((f.view(torch.int32) & 1) == 0)
    toward = torch.where(v > f.double(), torch.full_like(f, float("inf")), torch.full_like(f, float("-inf")))
    return torch.where(inexact, torch.nextafter(f, toward), f).to(dtype)


# ---- logits version --------------------------------------------------------------------------------------------------
class _LogitsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, local_labels, owned, nonowned, valid, temperature, token_temperature, return_entropy,
                group, batch_invariant, softcap, logit_scale):
        logp_l, _, stats = _ops.logp_entropy(logits, local_labels, temperature, token_temperature, _LOCAL_IGNORE,
                                             return_entropy, False, batch_invariant, softcap,
                                             logit_scale)  # local labels: in range
        n = logits.shape[0]
        tvec = _token_temperature(temperature, token_temperature, n, logits.device)
        if softcap is not None and logits.is_cuda:
            # The CUDA op's z_y is its float tanh of the label's logit (fused_logp.cu, label_logit), which no float64
            # transform here reproduces: recovered from its own logp (to that float's rounding), as the lm_head form
            # does, so that logp stays <= 0.
            zy = logp_l.double() + stats[:, 0]
        else:
            col = local_labels.clamp_min(0)[:, None]
            x = logits.gather(1, col).squeeze(1).double()  # the logits as the op reads them (float -> double)
            zy = reference.transform(x, softcap, logit_scale) / tvec  # the op's z_y
        lse, spz, logp, entropy = _combine(stats[:, 0], stats[:, 1], zy, owned, valid, return_entropy, group,
                                           batch_invariant)
        ctx.save_for_backward(logits, local_labels, nonowned, token_temperature, torch.stack([lse, spz], 1), tvec)
        ctx.temperature = temperature
        ctx.return_entropy = return_entropy
        ctx.batch_invariant = batch_invariant
        ctx.softcap, ctx.logit_scale = softcap, logit_scale
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if not ctx.needs_input_grad[0]:
            return (None,) * 12
        logits, local_labels, nonowned, token_temperature, stats, tvec = ctx.saved_tensors
        g = grad_logp.float().contiguous()
        ge = grad_entropy.float().contiguous() if ctx.return_entropy else None
        grad = _ops.logp_entropy_backward(g, ge, logits, local_labels, ctx.temperature, token_temperature, stats,
                                          _LOCAL_IGNORE, ctx.batch_invariant, ctx.softcap, ctx.logit_scale)
        # Rows whose label another rank owns: the op added g g'(x)/T at the dummy column. Overwrite that one element
        # with the value without the onehot term, -p (g + g_ent (z - sum_pz)) g'(x) / T, recomputed in float64 and
        # rounded as the op rounds (subtracting after rounding would lose the small -p g/T to cancellation). With a
        # softcap on CUDA, z here is the float64 tanh where the op used its float one: p off by that tanh's error
        # (~1e-6 relative) in this one element per row.
        col = local_labels.clamp_min(0)[:, None]
        x = logits.gather(1, col).squeeze(1).double()
        z = reference.transform(x, ctx.softcap, ctx.logit_scale) / tvec
        slope = reference.transform_slope(x, ctx.softcap, ctx.logit_scale)
        p = torch.exp(z - stats[:, 0])
        value = -(g.double() / tvec) * p
        if ge is not None:
            zero = torch.zeros_like(p)
            value = value - torch.where(p == 0, zero, (ge.double() / tvec) * p * (z - stats[:, 1]))
        value = value * slope
        current = grad.gather(1, col).squeeze(1)
        grad.scatter_(1, col, torch.where(nonowned, _round_like_op(value, grad.dtype), current)[:, None])
        return (grad,) + (None,) * 11


def logp_entropy_vocab_parallel(logits, labels, temperature=1.0, *, ignore_index=-100, return_entropy=True,
                                process_group, vocab_start=None, batch_invariant=False, softcap=None, logit_scale=1.0):
    """``ops.logp_entropy`` with logits sharded over the vocabulary: this rank's [..., V_local], global labels."""
    group = process_group
    device = logits.device if isinstance(logits, torch.Tensor) else _default_device(group)
    error = None
    x = l1 = tt = None
    scalar_t, n, v_local = 1.0, 0, 0
    try:
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"fused_logp: vocab_start must be a non-negative int or None, got {vocab_start!r}")
        x, l1, scalar_t, tt, _lead = flatten_logits(logits, labels, temperature)
        n, v_local = x.shape
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"fused_logp: logits dtype must be float32, bfloat16 or float16, got {x.dtype}")
        if l1.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"fused_logp: labels dtype must be int64 or int32, got {l1.dtype}")
        if tt is not None and tt.dtype != torch.float32:
            raise ValueError(f"fused_logp: a per-token temperature must be float32, got {tt.dtype}")
        if not (scalar_t > 0 and scalar_t < float("inf")):
            raise ValueError(f"fused_logp: temperature must be finite and > 0, got {scalar_t}")
    except Exception as e:  # raised on every rank by _agree, after the one collective
        error = e
    start, _total = _agree(group, device, error, n, v_local, vocab_start, 0, temperature, int(ignore_index),
                           return_entropy, False, l1, batch_invariant, softcap, logit_scale)
    local, owned, nonowned = _local_labels(l1, int(ignore_index), start, v_local)
    logp, entropy = _LogitsFn.apply(x, local, owned, nonowned, l1.long() != int(ignore_index), scalar_t, tt,
                                    bool(return_entropy), group, bool(batch_invariant), softcap, logit_scale)
    lead = logits.shape[:-1]
    return logp.reshape(lead), (entropy.reshape(lead) if return_entropy else None)


# ---- linear version --------------------------------------------------------------------------------------------------
class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, local_labels, owned, nonowned, valid, temperature, token_temperature,
                return_entropy, group, batch_invariant, softcap, logit_scale):
        logp_l, _, stats = _ops.linear_logp_entropy(hidden, weight, local_labels, temperature, token_temperature, bias,
                                                     _LOCAL_IGNORE, return_entropy, batch_invariant, softcap,
                                                     logit_scale)
        lse_l = stats[:, 0]
        zy = logp_l.double() + lse_l  # the owner's z_y (to the fp32 rounding of its logp)
        lse, spz, logp, entropy = _combine(lse_l, stats[:, 1], zy, owned, valid, return_entropy, group,
                                           batch_invariant)
        ctx.save_for_backward(hidden, weight, bias, local_labels, nonowned, token_temperature,
                              torch.stack([lse, spz], 1))
        ctx.softcap, ctx.logit_scale = softcap, logit_scale
        ctx.temperature = temperature
        ctx.return_entropy = return_entropy
        ctx.has_bias = bias is not None
        ctx.group = group
        ctx.batch_invariant = batch_invariant
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, local_labels, nonowned, token_temperature, stats = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        none = (None,) * 11
        if not (need_h or need_w or need_b):
            return (None, None, None) + none
        g = grad_logp.float().contiguous()
        ge = grad_entropy.float().contiguous() if ctx.return_entropy else None
        h_in, w_in = hidden, weight
        if need_h and hidden.device.type == "cpu" and hidden.dtype != torch.float32:
            # The CPU op computes from fp32 copies anyway; fp32 inputs make it return this rank's partial grad_hidden
            # unrounded, so it is rounded once, after the all-reduce. (CUDA takes 16-bit inputs only: there each
            # rank's partial is rounded to hidden's dtype once before the fp32 all-reduce.)
            h_in, w_in = hidden.float(), weight.float()
        # Rows whose label another rank owns get the label V_local: the backward op adds no onehot term for a label
        # outside [0, V) (no column matches), so their dZ is exactly -p (g + g_ent (z - sum_pz)) / T.
        labels = torch.where(nonowned, weight.shape[0], local_labels)
        gh, gw, gb = _ops.linear_logp_entropy_backward(g, ge, h_in, w_in, labels, ctx.temperature, token_temperature,
                                                       bias, stats, _LOCAL_IGNORE, [need_h, need_w, need_b], False,
                                                       ctx.batch_invariant, ctx.softcap, ctx.logit_scale)
        grad_hidden = grad_weight = grad_bias = None
        if need_w:
            grad_weight = gw.to(weight.dtype)
        if need_b:
            grad_bias = gb.to(bias.dtype)
        if need_h:
            # grad_hidden = sum over all vocab shards of dZ_r W_r: the one collective of the backward, in fp32
            # (a 16-bit all_reduce would round once per hop).
            gh32 = _sum_over_ranks(gh.float(), ctx.group, ctx.batch_invariant)
            grad_hidden = gh32.to(hidden.dtype)
        return (grad_hidden, grad_weight, grad_bias) + none


def linear_logp_entropy_vocab_parallel(hidden, weight, labels, temperature=1.0, *, bias=None, ignore_index=-100,
                                       return_entropy=True, fallback=None, process_group, vocab_start=None,
                                       batch_invariant=False, softcap=None, logit_scale=1.0):
    """``linear_ops.linear_logp_entropy`` with the lm_head sharded over the vocabulary: weight [V_local, H] (and bias
    [V_local]) of this rank, hidden [..., H] and global labels identical on every rank."""
    group = process_group
    device = hidden.device if isinstance(hidden, torch.Tensor) else _default_device(group)
    error = None
    h2 = l1 = tt = None
    temp, n, v_local, h_size, grad_hidden = 1.0, 0, 0, 0, False
    try:
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"linear_logp_entropy: vocab_start must be a non-negative int or None, got "
                             f"{vocab_start!r}")
        if fallback is not None:
            raise ValueError("linear_logp_entropy: fallback is not supported with a process_group")
        h2, l1, temp, tt = flatten_linear(hidden, weight, labels, temperature, bias)
        n, h_size = h2.shape
        v_local = weight.shape[0]
        reason = linear_contract.unsupported_shape_reason(h_size, v_local, n, h2.dtype, device=h2.device,
                                                     hidden=h2 if h2.is_cuda else None,
                                                     weight=weight if weight.is_cuda else None)
        if reason is not None:
            raise UnsupportedShapeError(f"linear_logp_entropy: {reason}")
        if weight.dtype != h2.dtype:
            raise ValueError(f"linear_logp_entropy: weight dtype must equal hidden's ({h2.dtype}), got {weight.dtype}")
        if l1.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"linear_logp_entropy: labels dtype must be int64 or int32, got {l1.dtype}")
        if not (temp > 0 and temp < float("inf")):
            raise ValueError(f"linear_logp_entropy: temperature must be finite and > 0, got {temp}")
        check_linear_transform(temp, softcap, logit_scale)
        grad_hidden = torch.is_grad_enabled() and h2.requires_grad
    except Exception as e:  # raised on every rank by _agree, after the one collective
        error = e
    start, _total = _agree(group, device, error, n, v_local, vocab_start, h_size, temperature, int(ignore_index),
                           return_entropy, grad_hidden, l1, batch_invariant, softcap, logit_scale)
    local, owned, nonowned = _local_labels(l1, int(ignore_index), start, v_local)
    logp, entropy = _LinearFn.apply(h2, weight, bias, local, owned, nonowned, l1.long() != int(ignore_index), temp, tt,
                                    bool(return_entropy), group, bool(batch_invariant), softcap, logit_scale)
    shape = labels.shape
    return logp.reshape(shape), (entropy.reshape(shape) if return_entropy else None)


__all__ = ["logp_entropy_vocab_parallel", "linear_logp_entropy_vocab_parallel"]
