"""linear_logp: numerics against float64 of log_softmax((hidden @ weight.T + bias) / T) on the same 16-bit inputs (error
no larger than 1.5x the PyTorch bf16-matmul + fp32-softmax path's), gradients likewise (relative Frobenius), autograd
(needs_input_grad, tied embedding), opcheck, torch.compile, error messages. CPU tests run everywhere;
``@pytest.mark.gpu`` tests need CUDA (and an sm_90 build). Seed printed; replay with LINEAR_LOGP_TEST_SEED=<seed>."""
from __future__ import annotations

import os
import time

import pytest
import torch
from prime_kernels_core.testing import assert_conforms, assert_error_ratio, kernel_module
from prime_kernels_fused_logp import inputs, reference

linear_ops = kernel_module("linear_logp", "prime_kernels_fused_logp.linear_ops")
from prime_kernels_fused_logp.linear_ops import linear_logp_entropy, unsupported_shape_reason  # noqa: E402

SEED = int(os.environ.get("LINEAR_LOGP_TEST_SEED", time.time_ns() % 2**31))
print(f"linear_logp tests: seed {SEED}")
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.kernel("linear_logp")]
MAX_RATIO = 1.5


def _paths(h, w, y, T, bias=None, ignore_index=-100, dtype64=False, softcap=None, logit_scale=1.0):
    """(logp, entropy) of the PyTorch path: 16-bit matmul + fp32 transform and softmax; with dtype64, the float64
    reference."""
    if dtype64:
        z = h.double() @ w.double().t()
        if bias is not None:
            z = z + bias.double()
    else:
        z = h @ w.t() if bias is None else torch.addmm(bias.to(h.dtype), h, w.t())
        z = z.float()
    z = reference.transform(z, softcap, logit_scale)
    Tt = T if not isinstance(T, torch.Tensor) else T.to(z.dtype).reshape(-1, 1)
    ls = torch.log_softmax(z / Tt, dim=-1)
    ok = y != ignore_index
    lp = ls.gather(1, torch.where(ok, y, 0)[:, None]).squeeze(1)
    ent = -(ls.exp() * ls.masked_fill(ls == float("-inf"), 0)).sum(-1)  # a -inf logit: p log p = 0, also in grads
    zero = torch.zeros_like(lp)
    return torch.where(ok, lp, zero), torch.where(ok, ent, zero)


def _inputs(n, h, v, dtype, device, scale=1.0, ignore=0.0, ignore_index=-100):
    hid = (torch.randn(n, h, device=device) * scale / h**0.25).to(dtype)
    w = (torch.randn(v, h, device=device) / h**0.25).to(dtype)
    y = torch.randint(0, v, (n,), device=device)
    if ignore:
        y[torch.rand(n, device=device) < ignore] = ignore_index
    return hid, w, y


def check_numerics(n, h, v, dtype=torch.bfloat16, device="cpu", T=0.7, scale=1.0, bias=False, ignore=0.1,
                   per_token=False, ignore_index=-100, grads=True, label="", batch_invariant=False, softcap=None,
                   logit_scale=1.0):
    hid, w, y = _inputs(n, h, v, dtype, device, scale, ignore, ignore_index)
    b = torch.randn(v, device=device) if bias else None
    if per_token:
        T = torch.rand(n, device=device) + 0.4
    tag = f"{label or 'case'} n={n} h={h} v={v} {str(dtype)[6:]} {device}"
    tf = dict(softcap=softcap, logit_scale=logit_scale)
    if softcap is not None or logit_scale != 1.0:
        tag += f" softcap={softcap} logit_scale={logit_scale}"
    leaves = [t.detach().requires_grad_() for t in (hid, w)] + ([b.detach().requires_grad_()] if bias else [])
    lp, ent = linear_logp_entropy(leaves[0], leaves[1], y, T, bias=leaves[2] if bias else None,
                                  ignore_index=ignore_index, batch_invariant=batch_invariant, **tf)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    lp64, ent64 = _paths(refs[0], refs[1], y, T, refs[2] if bias else None, ignore_index, dtype64=True, **tf)
    base = [t.detach().requires_grad_() for t in leaves]
    lpb, entb = _paths(base[0], base[1], y, T, base[2] if bias else None, ignore_index, **tf)
    assert_error_ratio(f"{tag} logp", lp, lpb, lp64, MAX_RATIO)
    assert_error_ratio(f"{tag} entropy", ent, entb, ent64, MAX_RATIO)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ok = y != ignore_index
    assert torch.all(lp[~ok] == 0) and torch.all(ent[~ok] == 0)
    if not grads:
        return
    g1, g2 = torch.randn(n, device=device), torch.randn(n, device=device)
    (lp * g1 + ent * g2).sum().backward()
    (lp64 * g1.double() + ent64 * g2.double()).sum().backward()
    (lpb * g1 + entb * g2).sum().backward()
    for name, ours, ref, bl in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, refs, base):
        assert ours.grad.dtype == ours.dtype
        assert_error_ratio(f"{tag} {name}", ours.grad, bl.grad, ref.grad, MAX_RATIO)


# ---- CPU numerics ---------------------------------------------------------------------------------------------------
def test_small_random():
    check_numerics(33, 64, 1000, label="small")
    check_numerics(33, 64, 1000, label="small batch_invariant", batch_invariant=True)


def test_vocab_32001():
    check_numerics(12, 32, 32001, label="V=32001", grads=False)
    check_numerics(6, 16, 32001, label="V=32001 grads")


def test_tokens_not_multiple_of_tile():
    check_numerics(linear_ops.BLOCK_N + 3, 16, 300, label="N=BLOCK_N+3")


def test_peaked():
    check_numerics(20, 64, 500, scale=12.0, T=0.5, label="peaked")


def test_ignored_and_custom_ignore_index():
    check_numerics(40, 32, 257, ignore=0.5, label="ignored")
    check_numerics(40, 32, 257, ignore=0.3, ignore_index=5, label="ignore_index=5")


def test_per_token_temperature_and_bias():
    check_numerics(24, 32, 700, per_token=True, label="per-token T")
    check_numerics(24, 32, 700, bias=True, label="bias")


def test_fp16():
    check_numerics(17, 48, 333, dtype=torch.float16, label="fp16")


def test_leading_dims_and_no_entropy():
    hid, w, y = _inputs(12, 16, 50, torch.bfloat16, "cpu")
    lp, ent = linear_logp_entropy(hid.reshape(3, 4, 16), w, y.reshape(3, 4), 0.9)
    lp2, ent2 = linear_logp_entropy(hid, w, y, 0.9, return_entropy=False)
    assert lp.shape == (3, 4) and ent2 is None
    torch.testing.assert_close(lp.reshape(-1), lp2)


def test_tied_embedding():
    """weight also used as the input embedding: both gradient contributions accumulate into weight.grad."""
    n, h, v = 10, 16, 90
    w = (torch.randn(v, h) / 2).bfloat16()
    ids, y = torch.randint(0, v, (n,)), torch.randint(0, v, (n,))
    proj = torch.randn(h, h).bfloat16()

    def loss(weight, fused):
        hid = torch.nn.functional.embedding(ids, weight) @ proj
        if fused:
            lp, ent = linear_logp_entropy(hid, weight, y, 0.8)
        else:
            lp, ent = _paths(hid, weight, y, 0.8, dtype64=weight.dtype == torch.float64)
        return (lp - 0.1 * ent).sum()

    ours, ref, base = w.clone().requires_grad_(), w.double().requires_grad_(), w.clone().requires_grad_()
    loss(ours, True).backward()
    proj64 = proj
    proj = proj64.double()
    loss(ref, False).backward()
    proj = proj64
    loss(base, False).backward()
    assert_error_ratio("tied embedding grad_weight", ours.grad, base.grad, ref.grad, MAX_RATIO)


def test_needs_input_grad(monkeypatch):
    masks = []  # the output_mask autograd passes to the backward op, per backward

    class RecordingOps:
        linear_logp_entropy = torch.ops.fused_logp.linear_logp_entropy

        @staticmethod
        def linear_logp_entropy_backward(*args):
            masks.append(list(args[10]))
            return torch.ops.fused_logp.linear_logp_entropy_backward(*args)

    monkeypatch.setattr(linear_ops, "_ops", RecordingOps)
    hid, w, y = _inputs(9, 16, 77, torch.bfloat16, "cpu")
    b = torch.randn(77)
    full = [t.clone().requires_grad_() for t in (hid, w)]
    lp, ent = linear_logp_entropy(*full, y, 0.7)
    (lp + ent).sum().backward()
    frozen_w = hid.clone().requires_grad_()
    lp, ent = linear_logp_entropy(frozen_w, w, y, 0.7)
    (lp + ent).sum().backward()
    torch.testing.assert_close(frozen_w.grad, full[0].grad, rtol=0, atol=0)
    frozen_h = w.clone().requires_grad_()
    lp, ent = linear_logp_entropy(hid, frozen_h, y, 0.7)
    (lp + ent).sum().backward()
    torch.testing.assert_close(frozen_h.grad, full[1].grad, rtol=0, atol=0)
    bias_only = b.clone().requires_grad_()
    lp, ent = linear_logp_entropy(hid, w, y, 0.7, bias=bias_only)
    (lp + ent).sum().backward()
    assert bias_only.grad is not None
    assert masks == [[True, True, False], [True, False, False], [False, True, False], [False, False, True]]
    # the backward op itself honours the mask: empty outputs where not requested
    _, _, stats = torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 0.7, None, None, -100, True)
    gh, gw, gb = torch.ops.fused_logp.linear_logp_entropy_backward(
        torch.ones(9), None, hid, w, y, 0.7, None, None, stats, -100, [True, False, False], False)
    assert gh.shape == hid.shape and gw.numel() == 0 and gb.numel() == 0


def test_grad_weight_fp32():
    hid, w, y = _inputs(9, 16, 77, torch.bfloat16, "cpu")
    _, _, stats = torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 0.7, None, None, -100, True)
    _, gw, _ = linear_ops.linear_logp_entropy_backward(torch.ones(9), torch.ones(9), hid, w, y, 0.7, stats=stats,
                                                       grad_weight_fp32=True)
    _, gw16, _ = linear_ops.linear_logp_entropy_backward(torch.ones(9), torch.ones(9), hid, w, y, 0.7, stats=stats)
    assert gw.dtype == torch.float32 and gw16.dtype == torch.bfloat16
    torch.testing.assert_close(gw.bfloat16(), gw16, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[*gpu, pytest.mark.skipif(not CUDA,
                                                                                                reason="needs CUDA")])])
def test_backward_label_outside_vocab_adds_no_onehot(device):
    """The backward op's rule the vocabulary-parallel path relies on: a label outside [0, V) (not ignore_index) gives
    dZ = -p (g + g_ent (z - sum_pz)) / T, the in-range gradient without its onehot term: grad_hidden and grad_weight
    differ from the in-range label's by exactly g/T times that token's weight row and hidden row (float64 check)."""
    n, hs, v = 9, 16, 77
    hid, w, y = _inputs(n, hs, v, torch.bfloat16, device)
    y[y == -100] = 5
    _, _, stats = torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 0.7, None, None, -100, True)
    g, ge = torch.randn(n, device=device), torch.randn(n, device=device)
    mask = [True, True, False]
    gh_in, gw_in, _ = torch.ops.fused_logp.linear_logp_entropy_backward(
        g, ge, hid, w, y, 0.7, None, None, stats, -100, mask, True)
    outside = torch.where(torch.arange(n, device=device) % 2 == 0, v, y)  # even tokens: label V (no column)
    gh_out, gw_out, _ = torch.ops.fused_logp.linear_logp_entropy_backward(
        g, ge, hid, w, outside, 0.7, None, None, stats, -100, mask, True)
    c = torch.where(outside == v, g.double() / 0.7, torch.zeros(n, dtype=torch.float64, device=device))
    onehot = torch.zeros(n, v, dtype=torch.float64, device=device)
    onehot[torch.arange(n, device=device), y] = c
    # CPU: dZ in float64, so grad_weight (fp32) differs by exactly that; CUDA: dZ goes to the GEMMs in 16 bits, so the
    # label element's rounding (~2^-9 of ~1) shows, as in grad_hidden (16-bit) on both. Without the rule the
    # difference would be 0, not ~0.5-1.
    tol = 1e-5 if device == "cpu" else 2e-2
    torch.testing.assert_close(gw_in.double() - gw_out.double(), onehot.t() @ hid.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(gh_in.double() - gh_out.double(), onehot @ w.double(), rtol=2e-2, atol=2e-2)


# Gemma's final_logit_softcapping 30, a softcap saturating most logits (4; scale 12: peaked rows), Cohere's
# logit_scale 0.0625, Granite's 1 / logits_scaling = 1 / 8, both transforms.
TRANSFORMS = [(30.0, 1.0), (4.0, 1.0), (None, 0.0625), (None, 0.125), (30.0, 0.5)]


@pytest.mark.parametrize("softcap, logit_scale", TRANSFORMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logit_transforms(softcap, logit_scale, dtype):
    tf = dict(softcap=softcap, logit_scale=logit_scale)
    check_numerics(40, 64, 300, dtype=dtype, label="transform", bias=True, **tf)
    check_numerics(40, 64, 300, dtype=dtype, label="transform per-token T", per_token=True, **tf)
    check_numerics(40, 64, 300, dtype=dtype, label="transform peaked T=0.5", scale=12.0, T=0.5, **tf)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[*gpu, pytest.mark.skipif(not CUDA,
                                                                                              reason="needs CUDA")])])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_vocab_one_gradients_are_exactly_zero(device, softcap):
    """V = 1: p = 1, so logp = entropy = 0 and every gradient is 0 (the float64 stats make the backward's p exactly 1)."""
    hid, w, y = _inputs(20, 64, 1, torch.bfloat16, device, ignore=0.2)
    leaves = [hid.requires_grad_(), w.requires_grad_(), torch.randn(1, device=device, requires_grad=True)]
    T = torch.rand(20, device=device) + 0.5
    lp, ent = linear_logp_entropy(leaves[0], leaves[1], y, T, bias=leaves[2], softcap=softcap)
    assert (lp == 0).all() and (ent == 0).all()
    (lp * torch.randn(20, device=device) + ent * torch.randn(20, device=device)).sum().backward()
    for name, leaf in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves):
        assert (leaf.grad == 0).all(), f"{name}: max |grad| {leaf.grad.abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_temperature_tensor_of_any_float_dtype_is_used_as_float32(dtype):
    """The one temperature rule (as ops.logp_entropy's): a floating temperature tensor is converted to float32."""
    hid, w, y = _inputs(6, 16, 30, torch.bfloat16, "cpu")
    t = (torch.rand(6) + 0.5).to(dtype)
    got, want = linear_logp_entropy(hid, w, y, t), linear_logp_entropy(hid, w, y, t.float())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(TypeError, match="temperature tensor must be floating point"):
        linear_logp_entropy(hid, w, y, torch.ones(6, dtype=torch.int64))


@pytest.mark.parametrize("kwargs, match", [
    (dict(softcap=0.0), "softcap must be finite and > 0"),
    (dict(softcap=-30.0), "softcap must be finite and > 0"),
    (dict(softcap=float("nan")), "softcap must be finite and > 0"),
    (dict(logit_scale=0.0), "logit_scale must be finite and > 0"),
    (dict(logit_scale=float("inf")), "logit_scale must be finite and > 0"),
])
def test_bad_logit_transform_names_the_argument(kwargs, match):
    hid, w, y = _inputs(4, 16, 30, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=match):
        linear_logp_entropy(hid, w, y, 1.0, **kwargs)
    with pytest.raises(RuntimeError, match="linear_logp: " + match.split(" must")[0]):
        torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 1.0, None, None, -100, True, False,
                                                 kwargs.get("softcap"), kwargs.get("logit_scale", 1.0))
    with pytest.raises(RuntimeError, match=r"temperature / softcap = .* must be a normal float32"):
        linear_logp_entropy(hid, w, y, 1e-30, softcap=1e10)  # each fine alone, their ratio a denormal


def test_conforms():
    assert_conforms("linear_logp")


@pytest.mark.parametrize("tf", [{}, dict(softcap=5.0, logit_scale=0.5)], ids=["plain", "softcap+scale"])
def test_compile_fullgraph(tf):
    hid, w, y = _inputs(8, 16, 40, torch.bfloat16, "cpu")
    T = torch.rand(8) + 0.5

    def fn(h, w):
        lp, ent = linear_logp_entropy(h, w, y, T, ignore_index=-100, **tf)
        return (lp * 2 + ent).sum()

    torch._dynamo.reset()
    a = [t.clone().requires_grad_() for t in (hid, w)]
    b = [t.clone().requires_grad_() for t in (hid, w)]
    fn(*a).backward()
    torch.compile(fn, fullgraph=True, backend="aot_eager")(*b).backward()
    for x, z in zip(a, b):
        torch.testing.assert_close(x.grad, z.grad)


def test_errors_name_the_argument():
    hid, w, y = _inputs(4, 16, 30, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="labels"):
        linear_logp_entropy(hid, w, y[:3], 1.0)
    with pytest.raises(ValueError, match="weight"):
        linear_logp_entropy(hid, w[:, :8], y, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        linear_logp_entropy(hid, w, y, torch.ones(3))
    with pytest.raises(ValueError, match="bias"):
        linear_logp_entropy(hid, w, y, 1.0, bias=torch.zeros(29))
    with pytest.raises(RuntimeError, match="weight dtype"):
        linear_logp_entropy(hid, w.half(), y, 1.0)
    with pytest.raises(RuntimeError, match="temperature"):
        linear_logp_entropy(hid, w, y, -1.0)
    for beyond_float32, shown in ((1e-40, "1e-40"), (1e39, r"1e\+39")):  # CUDA would see a denormal or inf
        with pytest.raises(RuntimeError, match=r"temperature must be a normal float32, in \[1.17549e-38, "
                                               rf"3.40282e\+38\], got {shown}"):
            linear_logp_entropy(hid, w, y, beyond_float32)
    with pytest.raises(RuntimeError, match=r"labels\[2\]"):
        linear_logp_entropy(hid, w, torch.tensor([0, 1, 30, 2]), 1.0)
    with pytest.raises(RuntimeError, match="token_temperature"):
        torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 1.0, torch.ones(3), None, -100, True)
    with pytest.raises(ValueError, match="fallback"):
        linear_logp_entropy(hid, w, y, 1.0, fallback="nope")
    with pytest.raises(ValueError, match=r"hidden size \(last dim of hidden\) must be >= 1, got 0"):
        linear_logp_entropy(hid[:, :0], w[:, :0], y, 1.0)


@pytest.mark.parametrize("name", ["weight", "labels", "temperature", "bias"])
def test_mixed_devices_name_the_argument(name):
    """One tensor on meta would run the fake implementation: uninitialised outputs instead of an error."""
    hid, w, y = _inputs(4, 16, 30, torch.bfloat16, "cpu")
    args = dict(weight=w, labels=y, temperature=torch.rand(4) + 0.5, bias=torch.randn(30))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on hidden's device cpu, got meta"):
        linear_logp_entropy(hid, args["weight"], args["labels"], args["temperature"], bias=args["bias"])


BAD_TEMPERATURES = [(0.0, "0"), (-1.5, "-1.5"), (float("inf"), "inf"), (float("nan"), "nan")]  # (value, as printed)


@pytest.mark.parametrize("bad, shown", BAD_TEMPERATURES, ids=[s for _, s in BAD_TEMPERATURES])
def test_bad_token_temperature_names_first_position(bad, shown):
    hid, w, y = _inputs(6, 16, 30, torch.bfloat16, "cpu")
    y[1] = -100
    temperature = torch.rand(6) + 0.5
    _, _, stats = torch.ops.fused_logp.linear_logp_entropy(hid, w, y, 1.0, temperature, None, -100, True)
    temperature[1] = bad  # an ignored token's temperature is never read
    temperature[3] = bad
    temperature[5] = bad
    match = rf"token_temperature\[3\] = {shown} must be finite and > 0"
    with pytest.raises(RuntimeError, match=match):
        linear_logp_entropy(hid.reshape(2, 3, 16), w, y.reshape(2, 3), temperature.reshape(2, 3))
    with pytest.raises(RuntimeError, match=match):
        linear_ops.linear_logp_entropy_backward(torch.ones(6), torch.ones(6), hid, w, y, temperature, stats=stats)


def test_shape_contract():
    assert unsupported_shape_reason(4096, 151936) is None
    assert "multiple of" in unsupported_shape_reason(4100, 1000)
    assert "dtype" in unsupported_shape_reason(4096, 1000, dtype=torch.float32)
    assert unsupported_shape_reason(4100, 1000, device="cpu") is None
    assert "vocab_size" in unsupported_shape_reason(64, 0)
    from prime_kernels_core.contracts import ShapeContract

    assert isinstance(linear_ops, ShapeContract)


@pytest.mark.parametrize("tf", [{}, dict(softcap=4.0, logit_scale=0.5)], ids=["plain", "softcap+scale"])
def test_chunked_fallback_matches(tf):
    pytest.importorskip("prime_kernels_fused_logp.ops")
    hid, w, y = _inputs(10, 16, 300, torch.bfloat16, "cpu", ignore=0.2)
    b = torch.randn(300)
    a = [t.clone().requires_grad_() for t in (hid, w, b)]
    c = [t.clone().requires_grad_() for t in (hid, w, b)]
    lp, ent = linear_logp_entropy(a[0], a[1], y, 0.7, bias=a[2], **tf)
    h2, l1, temp, tt = inputs.flatten_linear(c[0], c[1], y, 0.7, c[2])
    lpc, entc = linear_ops._chunked(h2, c[1], l1, temp, tt, c[2], -100, 128, tf.get("softcap"),
                                    tf.get("logit_scale", 1.0))
    torch.testing.assert_close(lpc, lp, rtol=2e-2, atol=2e-2)  # chunked rounds logits to bf16
    torch.testing.assert_close(entc, ent, rtol=2e-2, atol=2e-2)
    (lp + ent).sum().backward()
    (lpc + entc).sum().backward()
    for x, z in zip(a, c):
        assert (x.grad.double() - z.grad.double()).norm() / x.grad.double().norm() < 3e-2


def test_chunked_fallback_out_of_range_labels_give_nan():
    """As the CUDA kernel (no sync): NaN logp and entropy for those tokens only; the others are unchanged."""
    hid, w, _ = _inputs(6, 16, 300, torch.bfloat16, "cpu")
    y = torch.tensor([0, 299, 300, -3, -100, 150])
    lp, ent = linear_ops._chunked(hid, w, y, 0.7, None, None, -100, 128)
    bad = torch.tensor([False, False, True, True, False, False])
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all()
    lp_ok, ent_ok = linear_ops._chunked(hid, w, torch.where(bad, 7, y), 0.7, None, None, -100, 128)
    assert torch.equal(lp[~bad], lp_ok[~bad]) and torch.equal(ent[~bad], ent_ok[~bad])
    assert lp[4] == 0 and ent[4] == 0


def test_chunked_fallback_dead_chunk():
    """A vocab chunk whose logits are all -inf (a -inf bias on padded vocab rows) contributes nothing: padding the vocab
    with one leaves outputs and gradients bitwise unchanged (zero gradient on the padding); accuracy as the PyTorch
    path's against float64, values as the op's."""
    n, h, live, padded, chunk = 64, 16, 256, 300, 128
    hid, w, y = _inputs(n, h, padded, torch.bfloat16, "cpu", ignore=0.2)
    y = torch.where(y >= live, y - live, y)
    b = torch.randn(padded)
    b[live:] = float("-inf")  # the last chunk, [256, 300), is all -inf
    full = [t.clone().requires_grad_() for t in (hid, w, b)]
    cut = [t.clone().requires_grad_() for t in (hid, w[:live], b[:live])]
    lp, ent = linear_ops._chunked(full[0], full[1], y, 0.7, None, full[2], -100, chunk)
    lp_cut, ent_cut = linear_ops._chunked(cut[0], cut[1], y, 0.7, None, cut[2], -100, chunk)
    assert torch.equal(lp, lp_cut) and torch.equal(ent, ent_cut)
    g1, g2 = torch.randn(n), torch.randn(n)
    (lp * g1 + ent * g2).sum().backward()
    (lp_cut * g1 + ent_cut * g2).sum().backward()
    assert torch.equal(full[0].grad, cut[0].grad)
    for padded_grad, live_grad in ((full[1].grad, cut[1].grad), (full[2].grad, cut[2].grad)):
        assert torch.equal(padded_grad[:live], live_grad) and (padded_grad[live:] == 0).all()
    lp64, ent64 = _paths(hid.double(), w.double(), y, 0.7, b.double(), dtype64=True)
    lpb, entb = _paths(hid, w, y, 0.7, b)
    assert_error_ratio("dead chunk logp", lp, lpb, lp64, MAX_RATIO)
    assert_error_ratio("dead chunk entropy", ent, entb, ent64, MAX_RATIO)
    lp_op, ent_op = linear_logp_entropy(hid, w, y, 0.7, bias=b)
    torch.testing.assert_close(lp, lp_op, rtol=2e-2, atol=2e-2)  # the fallback rounds logits to bf16
    torch.testing.assert_close(ent, ent_op, rtol=2e-2, atol=2e-2)


# ---- GPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_small(dtype, inv):
    check_numerics(64, 64, 1000, dtype=dtype, device="cuda", label="gpu small", batch_invariant=inv)
    check_numerics(linear_ops.BLOCK_N + 5, 128, 32001, dtype=dtype, device="cuda", label="gpu N=BLOCK_N+5",
                   bias=True, per_token=True, batch_invariant=inv)
    check_numerics(300, 200, 777, dtype=dtype, device="cuda", label="gpu H=200 (partial K tile)", ignore=0.3,
                   batch_invariant=inv)
    check_numerics(50, 64, 500, dtype=dtype, device="cuda", scale=12.0, T=0.5, label="gpu peaked",
                   batch_invariant=inv)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("softcap, logit_scale", TRANSFORMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_logit_transforms(softcap, logit_scale, dtype):
    tf = dict(softcap=softcap, logit_scale=logit_scale)
    check_numerics(64, 64, 1000, dtype=dtype, device="cuda", label="gpu transform", **tf)
    check_numerics(linear_ops.BLOCK_N + 5, 128, 32001, dtype=dtype, device="cuda", label="gpu transform N=BLOCK_N+5",
                   bias=True, per_token=True, **tf)
    check_numerics(50, 64, 500, dtype=dtype, device="cuda", scale=12.0, T=0.5, label="gpu transform peaked",
                   batch_invariant=True, **tf)
    check_numerics(256, 4096, 151936, dtype=dtype, device="cuda", T=0.7, label="gpu transform V=151936", **tf)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_softcap_nan_and_inf_match_cpu():
    """A NaN hidden row makes its token NaN (the epilogue's tanh keeps NaN); -inf / +inf bias entries are -softcap /
    +softcap, finite, as on CPU."""
    hid, w, y = _inputs(40, 64, 700, torch.bfloat16, "cpu", ignore=0.1)
    hid[3, 5] = float("nan")
    y[3] = 1  # a labelled token: an ignored one (10 % of seeds) has logp 0 whatever its row holds
    b = torch.randn(700)
    b[::7] = float("-inf")
    b[3::11] = float("inf")
    T = torch.rand(40) + 0.5
    outs = []
    for dev in ("cpu", "cuda"):
        h = hid.to(dev).detach().requires_grad_()  # a leaf: on the CPU .to returns hid itself
        lp, ent = linear_logp_entropy(h, w.to(dev), y.to(dev), T.to(dev), bias=b.to(dev), softcap=5.0)
        (lp.nan_to_num() + ent.nan_to_num()).sum().backward()
        outs.append((lp.detach().cpu(), ent.detach().cpu(), h.grad.cpu()))
    (lp_c, ent_c, g_c), (lp_g, ent_g, g_g) = outs
    assert torch.isnan(lp_g[3]) and torch.isnan(ent_g[3])
    others = torch.arange(40) != 3
    assert torch.isfinite(lp_g[others]).all() and torch.isfinite(g_g[others]).all()
    torch.testing.assert_close(lp_g, lp_c, rtol=1e-3, atol=1e-3, equal_nan=True)
    torch.testing.assert_close(ent_g, ent_c, rtol=1e-3, atol=1e-3, equal_nan=True)
    torch.testing.assert_close(g_g[others], g_c[others], rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("n", [256, 300])
@pytest.mark.parametrize("inv", [False, True], ids=["default", "batch_invariant"])
def test_gpu_qwen_vocab(n, inv):
    check_numerics(n, 4096, 151936, device="cuda", T=0.7, label=f"gpu V=151936 H=4096 invariant={inv}",
                   batch_invariant=inv)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_multi_chunk_backward_and_determinism():
    """N large enough that the backward's dZ buffer holds fewer vocab tiles than V (several chunks)."""
    n = 4096
    v = 3 * (linear_ops.DZ_CHUNK_ELEMS // n) + 1000
    check_numerics(n, 64, v, device="cuda", label="gpu multi-chunk", ignore=0.05)
    hid, w, y = _inputs(n, 64, v, torch.bfloat16, "cuda")
    outs = []
    for _ in range(2):
        a = [t.clone().requires_grad_() for t in (hid, w)]
        lp, ent = linear_logp_entropy(*a, y, 0.7)
        (lp + ent).sum().backward()
        outs.append((lp, ent, a[0].grad, a[1].grad))
    for x, z in zip(*outs):
        assert torch.equal(x, z)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_matches_cpu_and_misc():
    hid, w, y = _inputs(70, 64, 1234, torch.bfloat16, "cpu", ignore=0.2)
    T = torch.rand(70) + 0.5
    lp_c, ent_c = linear_logp_entropy(hid, w, y, T)
    lp_g, ent_g = linear_logp_entropy(hid.cuda(), w.cuda(), y.cuda(), T.cuda())
    torch.testing.assert_close(lp_g.cpu(), lp_c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent_g.cpu(), ent_c, rtol=1e-4, atol=1e-4)
    # out-of-range label on CUDA: NaN, no error, no out-of-bounds access
    yb = y.cuda().clone()
    yb[3] = 5000
    lp_b, _ = linear_logp_entropy(hid.cuda(), w.cuda(), yb, 1.0)
    assert torch.isnan(lp_b[3]) and not torch.isnan(lp_b[torch.arange(70, device="cuda") != 3]).any()
    # an unsupported shape: a reason, or the chunked fallback when asked
    h_bad, w_bad = hid[:, :60].cuda(), w[:, :60].cuda()
    with pytest.raises(ValueError, match="multiple of"):
        linear_logp_entropy(h_bad, w_bad, y.cuda(), 1.0)
    if _has_logits_ops():
        lp_f, _ = linear_logp_entropy(h_bad, w_bad, y.cuda(), 1.0, fallback="chunked")
        lp_r, _ = linear_logp_entropy(h_bad.cpu(), w_bad.cpu(), y, 1.0)
        torch.testing.assert_close(lp_f.cpu(), lp_r, rtol=2e-2, atol=2e-2)
    # frozen weight / frozen hidden on CUDA
    a = hid.cuda().requires_grad_()
    lp, ent = linear_logp_entropy(a, w.cuda(), y.cuda(), 0.7)
    (lp + ent).sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.bfloat16
    # compile on CUDA
    torch._dynamo.reset()
    f = torch.compile(lambda h, w: linear_logp_entropy(h, w, y.cuda(), 0.7)[0].sum(), fullgraph=True,
                      backend="aot_eager")
    torch.testing.assert_close(f(hid.cuda(), w.cuda()), lp_g.sum() * 0 + linear_logp_entropy(
        hid.cuda(), w.cuda(), y.cuda(), 0.7)[0].sum())


def _has_logits_ops():
    try:
        import prime_kernels_fused_logp.ops  # noqa: F401
        return True
    except ImportError:
        return False
