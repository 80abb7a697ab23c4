"""fused_logp: numerics against float64 (error no larger than the fp32 PyTorch path's), autograd, opcheck, compile,
edge cases and error messages. CPU tests run everywhere in a few seconds; ``@pytest.mark.gpu`` tests need CUDA.

Inputs are fresh random draws each run; the seed is printed (``pytest -s``) so a failure can be replayed with
FUSED_LOGP_TEST_SEED=<seed>. Error margins print as ``<label>: error ..., PyTorch path ..., ratio ...``."""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from prime_kernels_core.testing import assert_conforms, assert_error_ratio, kernel_module
from prime_kernels_fused_logp import reference

ops = kernel_module("fused_logp", "prime_kernels_fused_logp.ops")
logp_entropy = ops.logp_entropy

SEED = int(os.environ.get("FUSED_LOGP_TEST_SEED", time.time_ns() % 2**31))
print(f"fused_logp tests: seed {SEED}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")]


def make_logits(n, v, dtype, device="cpu", kind="random", scale=3.0):
    x = torch.randn(n, v, device=device) * scale
    if kind == "peaked":
        x[torch.arange(n, device=device), torch.randint(0, v, (n,), device=device)] += 30.0
    elif kind == "equal":
        x = torch.full((n, v), 1.7, device=device)
    return x.to(dtype)


def make_labels(n, v, device="cpu", ignore_frac=0.2, dtype=torch.int64):
    y = torch.randint(0, v, (n,), device=device)
    y[torch.rand(n, device=device) < ignore_frac] = -100
    return y.to(dtype)


def check_against_float64(label, logits, labels, temperature=1.0, grads=True, ignore_index=-100,
                          batch_invariant=False, softcap=None, logit_scale=1.0):
    """Our logp / entropy / gradient vs the fp32 PyTorch path, both against float64: error ratio <= 1."""
    x_ours = logits.detach().clone().requires_grad_(grads)
    x_ref = logits.detach().clone().requires_grad_(grads)
    tf = dict(softcap=softcap, logit_scale=logit_scale)
    lp, ent = logp_entropy(x_ours, labels, temperature, ignore_index=ignore_index, batch_invariant=batch_invariant, **tf)
    lp_ref, ent_ref = reference.logp_entropy_reference(x_ref, labels, temperature, ignore_index=ignore_index, **tf)
    lp64, ent64 = reference.logp_entropy_float64(logits.detach(), labels, temperature, ignore_index=ignore_index, **tf)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert lp.shape == labels.shape and ent.shape == labels.shape
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert_error_ratio(f"{label} logp", lp, lp_ref, lp64)
    assert_error_ratio(f"{label} entropy", ent, ent_ref, ent64)
    if not grads:
        return
    g_lp = torch.randn_like(lp)
    g_ent = torch.randn_like(ent)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    torch.autograd.backward((lp_ref, ent_ref), (g_lp, g_ent))
    g64 = reference.logp_entropy_grad_float64(logits.detach(), labels, g_lp, g_ent, temperature, ignore_index=ignore_index,
                                              **tf)
    assert x_ours.grad.dtype == logits.dtype and x_ours.grad.shape == logits.shape
    assert torch.isfinite(x_ours.grad).all()
    assert_error_ratio(f"{label} grad", x_ours.grad, x_ref.grad, g64)


# ---- CPU numerics -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked"])
@pytest.mark.parametrize("shape", [(64, 257), (16, 131), (3, 7, 193)], ids=str)
def test_cpu_matches_float64(dtype, kind, shape):
    *lead, v = shape
    n = int(torch.tensor(lead).prod())
    logits = make_logits(n, v, dtype, kind=kind).reshape(*lead, v)
    labels = make_labels(n, v).reshape(*lead)
    check_against_float64(f"cpu {dtype} {kind} {shape}", logits, labels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_temperature(dtype):
    logits, labels = make_logits(32, 300, dtype), make_labels(32, 300)
    check_against_float64(f"cpu {dtype} T=0.7", logits, labels, 0.7)
    check_against_float64(f"cpu {dtype} T=0.7 batch_invariant", logits, labels, 0.7, batch_invariant=True)
    check_against_float64(f"cpu {dtype} T=1.9", logits, labels, 1.9)
    per_token = (torch.rand(32) * 1.5 + 0.25).float()
    check_against_float64(f"cpu {dtype} per-token T", logits, labels, per_token)
    check_against_float64(f"cpu {dtype} 0-d T", logits, labels, torch.tensor(0.7))
    broadcast = logp_entropy(logits, labels, torch.tensor(0.7))
    expanded = logp_entropy(logits, labels, torch.full((32,), 0.7))
    assert torch.equal(broadcast[0], expanded[0]) and torch.equal(broadcast[1], expanded[1])


# Gemma 2/3's final_logit_softcapping is 30 (logits of a few tens reach it); 4 saturates most of these logits (x ~ 3
# randn, peaked + 30). logit_scale 0.0625 is Cohere Command-R's, 1 / 8 a Granite logits_scaling.
TRANSFORMS = [(30.0, 1.0), (4.0, 1.0), (None, 0.0625), (None, 1 / 8), (30.0, 0.5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked"])
@pytest.mark.parametrize("softcap, logit_scale", TRANSFORMS, ids=str)
def test_cpu_logit_transforms(dtype, kind, softcap, logit_scale):
    n, v = 64, 257
    logits, labels = make_logits(n, v, dtype, kind=kind), make_labels(n, v)
    tag = f"cpu {dtype} {kind} softcap={softcap} logit_scale={logit_scale}"
    tf = dict(softcap=softcap, logit_scale=logit_scale)
    check_against_float64(f"{tag} T=1", logits, labels, **tf)
    check_against_float64(f"{tag} T=0.7", logits, labels, 0.7, **tf)
    check_against_float64(f"{tag} per-token T", logits, labels, torch.rand(n) * 1.5 + 0.25, **tf)


def test_cpu_logit_transform_defaults_are_bitwise_the_plain_op():
    logits, labels = make_logits(16, 131, torch.bfloat16).requires_grad_(), make_labels(16, 131)
    plain = logp_entropy(logits, labels, 0.7)
    explicit = logp_entropy(logits, labels, 0.7, softcap=None, logit_scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, explicit))
    # a logit_scale is a temperature: z = s x / T exactly in double on CPU
    scaled = logp_entropy(logits, labels, 0.7, logit_scale=0.5)
    halved = logp_entropy(logits, labels, 1.4)
    torch.testing.assert_close(scaled[0], halved[0], rtol=1e-6, atol=1e-6)


def test_cpu_softcap_keeps_nan():
    logits, labels = make_logits(6, 40, torch.bfloat16), make_labels(6, 40, ignore_frac=0.0)
    logits[2, 7] = float("nan")
    x = logits.clone().requires_grad_()
    lp, ent = logp_entropy(x, labels, softcap=5.0)
    (lp.sum() + ent.sum()).backward()
    assert torch.isnan(lp[2]) and torch.isnan(ent[2]) and torch.isnan(x.grad[2]).all()
    others = [0, 1, 3, 4, 5]
    assert torch.isfinite(lp[others]).all() and torch.isfinite(x.grad[others]).all()


def test_cpu_softcap_maps_neg_inf_to_minus_cap():
    """softcap * tanh(-inf / softcap) = -softcap: a -inf logit is an ordinary (small) one after the cap."""
    logits = make_logits(8, 33, torch.float32)
    labels = make_labels(8, 33, ignore_frac=0.0)
    logits[:, 5] = float("-inf")
    x = logits.clone().requires_grad_()
    lp, ent = logp_entropy(x, labels, softcap=3.0)
    lp64, ent64 = reference.logp_entropy_float64(logits, labels, softcap=3.0)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), lp64, rtol=1e-6, atol=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, 5] == 0).all()  # d tanh at -inf = 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(softcap=0.0), "softcap must be finite and > 0"),
    (dict(softcap=-30.0), "softcap must be finite and > 0"),
    (dict(softcap=float("inf")), "softcap must be finite and > 0"),
    (dict(softcap=float("nan")), "softcap must be finite and > 0"),
    (dict(softcap=1e-39), "softcap must be finite and > 0 .a normal float32"),
    (dict(logit_scale=0.0), "logit_scale must be finite and > 0"),
    (dict(logit_scale=-1.0), "logit_scale must be finite and > 0"),
    (dict(logit_scale=float("nan")), "logit_scale must be finite and > 0"),
    (dict(logit_scale=1e39), "logit_scale must be finite and > 0"),
    (dict(softcap=1e-20, logit_scale=1e20), "logit_scale / softcap must be in"),
])
def test_cpu_bad_logit_transform_names_the_argument(kwargs, match):
    logits, labels = make_logits(4, 9, torch.float32), make_labels(4, 9)
    with pytest.raises(ValueError, match=match):
        logp_entropy(logits, labels, **kwargs)
    op_args = (logits, labels, 1.0, None, -100, True, True, False, kwargs.get("softcap"), kwargs.get("logit_scale", 1.0))
    with pytest.raises(RuntimeError, match="fused_logp: " + match.split(" must")[0]):
        torch.ops.fused_logp.logp_entropy(*op_args)
    with pytest.raises(TypeError, match="softcap must be None or a real number, got str"):
        logp_entropy(logits, labels, softcap="30")


def test_cpu_effective_temperature_must_stay_a_normal_float32():
    """T / logit_scale (or T / softcap): the CUDA kernels form log2(e) w / T as floats; the same rule on every device
    and for both ops."""
    logits, labels = make_logits(4, 9, torch.float32), make_labels(4, 9)
    with pytest.raises(RuntimeError, match=r"fused_logp: temperature / logit_scale = .* must be a normal float32"):
        logp_entropy(logits, labels, 1e-2, logit_scale=1e37)
    with pytest.raises(RuntimeError, match=r"fused_logp: temperature / softcap = .* must be a normal float32"):
        logp_entropy(logits, labels, 1e-30, softcap=1e10)
    with pytest.raises(RuntimeError, match=r"temperature / logit_scale = .* must be a normal float32"):  # the fake
        torch.ops.fused_logp.logp_entropy(logits.to("meta"), labels.to("meta"), 1e-2, None, -100, True, False, False,
                                          None, 1e37)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_cpu_temperature_tensor_of_any_float_dtype_is_used_as_float32(dtype):
    """The one temperature rule (both ops): a floating temperature tensor is converted to float32."""
    logits, labels = make_logits(12, 50, torch.float32), make_labels(12, 50)
    t = (torch.rand(12) + 0.5).to(dtype)
    got = logp_entropy(logits, labels, t)
    want = logp_entropy(logits, labels, t.float())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got0 = logp_entropy(logits, labels, torch.tensor(0.7, dtype=dtype))
    want0 = logp_entropy(logits, labels, torch.tensor(0.7, dtype=dtype).float())
    assert torch.equal(got0[0], want0[0])
    with pytest.raises(TypeError, match="temperature tensor must be floating point"):
        logp_entropy(logits, labels, torch.ones(12, dtype=torch.int64))


def test_cpu_large_vocab():
    logits, labels = make_logits(4, 151936, torch.bfloat16), make_labels(4, 151936, ignore_frac=0.0)
    check_against_float64("cpu bf16 V=151936", logits, labels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_all_equal_logits(dtype):
    v = 257
    logits, labels = make_logits(8, v, dtype, kind="equal"), make_labels(8, v, ignore_frac=0.0)
    lp, ent = logp_entropy(logits, labels)
    expect = torch.log(torch.tensor(float(v), dtype=torch.float64))
    torch.testing.assert_close(lp.double(), -expect.expand(8), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.double(), expect.expand(8), rtol=0, atol=1e-6)
    check_against_float64(f"cpu {dtype} equal", logits, labels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_neg_inf_entries(dtype):
    n, v = 16, 257
    logits = make_logits(n, v, dtype)
    labels = make_labels(n, v)
    mask = torch.rand(n, v) < 0.3
    mask[torch.arange(n), labels.clamp(min=0)] = False  # the label itself stays finite
    logits = logits.masked_fill(mask, float("-inf"))
    lp, ent = logp_entropy(logits, labels)
    lp_ref, ent_ref = reference.logp_entropy_reference(logits, labels)
    lp64, ent64 = reference.logp_entropy_float64(logits, labels)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert_error_ratio(f"cpu {dtype} -inf logp", lp, lp_ref, lp64)
    assert_error_ratio(f"cpu {dtype} -inf entropy", ent, ent_ref, ent64)
    x = logits.clone().requires_grad_()
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    lp, ent = logp_entropy(x, labels)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    g64 = reference.logp_entropy_grad_float64(logits, labels, g_lp, g_ent)
    assert torch.isfinite(x.grad).all()
    assert (x.grad[mask] == 0).all()
    torch.testing.assert_close(x.grad.double(), g64, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-7)


def test_cpu_vocab_one():
    logits = torch.randn(5, 1, requires_grad=True)
    labels = torch.tensor([0, 0, -100, 0, 0])
    lp, ent = logp_entropy(logits, labels, 0.5)
    assert (lp == 0).all() and (ent == 0).all()
    (lp.sum() + ent.sum()).backward()
    assert (logits.grad == 0).all()


def test_cpu_no_tokens():
    logits = torch.randn(0, 33, requires_grad=True)
    lp, ent = logp_entropy(logits, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 33)
    lp, ent = logp_entropy(torch.randn(2, 0, 9), torch.zeros(2, 0, dtype=torch.long))
    assert lp.shape == (2, 0) and ent.shape == (2, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_ignored_tokens_and_nan_isolation(dtype):
    n, v = 12, 131
    logits = make_logits(n, v, dtype)
    labels = make_labels(n, v, ignore_frac=0.0)
    labels[[2, 7]] = -100
    logits[2, 5] = float("nan")  # ignored and NaN: still 0 / 0 / zero gradient
    logits[4, 9] = float("nan")  # a NaN token: NaN for that token only
    x = logits.clone().requires_grad_()
    lp, ent = logp_entropy(x, labels)
    (lp.sum() + ent.sum()).backward()
    assert lp[2] == 0 and ent[2] == 0 and lp[7] == 0 and ent[7] == 0
    assert (x.grad[2] == 0).all() and (x.grad[7] == 0).all()
    assert torch.isnan(lp[4]) and torch.isnan(ent[4]) and torch.isnan(x.grad[4]).all()
    others = [i for i in range(n) if i != 4]
    assert torch.isfinite(lp[others]).all() and torch.isfinite(ent[others]).all()
    assert torch.isfinite(x.grad[others]).all()
    clean = logits.clone()
    clean[4] = 0
    lp_clean, ent_clean = logp_entropy(clean, labels)
    assert torch.equal(lp[others], lp_clean[others]) and torch.equal(ent[others], ent_clean[others])


def test_cpu_custom_ignore_index_and_int32_labels():
    logits, labels = make_logits(20, 100, torch.float32), make_labels(20, 100, ignore_frac=0.0)
    labels[3] = 7
    lp64, ent64 = logp_entropy(logits, labels, ignore_index=7)
    lp32, ent32 = logp_entropy(logits, labels.int(), ignore_index=7)
    assert lp64[3] == 0 and ent64[3] == 0
    assert torch.equal(lp64, lp32) and torch.equal(ent64, ent32)


def test_cpu_strided_logits():
    base = make_logits(8, 300, torch.bfloat16)
    labels = make_labels(8, 257)
    sliced = base[:, 3:260]  # row stride 300, not 16-byte aligned
    transposed = base[:, 3:260].t().contiguous().t()  # last-dim stride != 1
    ref = logp_entropy(sliced.contiguous(), labels)
    for view in (sliced, transposed):
        got = logp_entropy(view, labels)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    x = sliced.detach().clone().requires_grad_()
    x2 = base.detach().clone().requires_grad_()
    lp, ent = logp_entropy(x2[:, 3:260], labels)
    (lp.sum() + ent.sum()).backward()
    lp_c, ent_c = logp_entropy(x, labels)
    (lp_c.sum() + ent_c.sum()).backward()
    assert torch.equal(x2.grad[:, 3:260], x.grad) and (x2.grad[:, :3] == 0).all()


def test_cpu_without_entropy():
    logits, labels = make_logits(10, 50, torch.float32), make_labels(10, 50)
    x = logits.clone().requires_grad_()
    lp, ent = logp_entropy(x, labels, 0.8, return_entropy=False)
    assert ent is None
    g = torch.randn(10)
    lp.backward(g)
    g64 = reference.logp_entropy_grad_float64(logits, labels, g, None, 0.8)
    torch.testing.assert_close(x.grad.double(), g64, rtol=1e-5, atol=1e-7)
    lp_e, _ = logp_entropy(logits, labels, 0.8)
    assert torch.equal(lp, lp_e)


# ---- errors -------------------------------------------------------------------------------------------------------
def test_cpu_bad_label_names_first_position():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 2] = 11
    labels[1, 4] = -3
    with pytest.raises(RuntimeError, match=r"labels\[7\] = 11 is out of range.*\[0, 11\)"):
        logp_entropy(logits, labels)
    with pytest.raises(RuntimeError, match=r"labels\[7\] = 11"):  # CPU always checks
        logp_entropy(logits, labels, check_labels=False)


BAD_TEMPERATURES = [(0.0, "0"), (-1.5, "-1.5"), (float("inf"), "inf"), (float("nan"), "nan")]  # (value, as printed)


@pytest.mark.parametrize("bad, shown", BAD_TEMPERATURES, ids=[s for _, s in BAD_TEMPERATURES])
def test_cpu_bad_token_temperature_names_first_position(bad, shown):
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    labels[0, 1] = -100
    temperature = torch.rand(2, 3) + 0.5
    _, _, stats = torch.ops.fused_logp.logp_entropy(logits.reshape(6, 11), labels.reshape(6), 1.0,
                                                    temperature.reshape(6), -100, True, True)
    temperature[0, 1] = bad  # an ignored token's temperature is never read
    temperature[1, 0] = bad
    temperature[1, 2] = bad
    match = rf"token_temperature\[3\] = {shown} must be finite and > 0"
    with pytest.raises(RuntimeError, match=match):
        logp_entropy(logits, labels, temperature)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fused_logp.logp_entropy_backward(torch.ones(6), torch.ones(6), logits.reshape(6, 11),
                                                   labels.reshape(6), 1.0, temperature.reshape(6), stats, -100)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: logp_entropy(torch.randn(3, 8).double(), torch.zeros(3, dtype=torch.long)), "logits dtype must be float32, bfloat16 or float16, got Double"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3)), "labels dtype must be int64 or int32, got Float"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(4, dtype=torch.long)), r"labels shape \(4,\) must equal logits' leading shape \(3,\)"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), 0.0), "temperature must be finite and > 0, got 0"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), -2.0), "temperature must be finite and > 0, got -2"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), float("nan")), "temperature must be finite and > 0, got nan"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), torch.ones(4)), r"per-token temperature shape \(4,\) must equal logits' leading shape \(3,\)"),
        # one tensor on meta would run the fake implementation: uninitialised outputs instead of an error
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long, device="meta")), "labels must be on logits' device cpu, got meta"),
        (lambda: logp_entropy(torch.randn(3, 8, device="meta"), torch.zeros(3, dtype=torch.long)), "labels must be on logits' device meta, got cpu"),
        (lambda: logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), torch.ones(3, device="meta")), "temperature must be on logits' device cpu, got meta"),
        (lambda: logp_entropy(torch.randn(3, 0), torch.zeros(3, dtype=torch.long)), "vocab size .* must be >= 1, got 0"),
        (lambda: logp_entropy(torch.tensor(1.0), torch.tensor(0)), "logits must have at least 1 dim"),
        (lambda: torch.ops.fused_logp.logp_entropy(torch.randn(8), torch.zeros(1, dtype=torch.long), 1.0, None, -100, True, True), r"logits must be 2-D \[N, V\], got 1-D"),
        (lambda: torch.ops.fused_logp.logp_entropy(torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.long), 1.0, None, -100, True, True), r"labels must be 1-D \[N\], got 2-D"),
        (lambda: torch.ops.fused_logp.logp_entropy(torch.randn(3, 8), torch.zeros(2, dtype=torch.long), 1.0, None, -100, True, True), r"labels must have N = 3 entries \(logits rows\), got 2"),
        (lambda: torch.ops.fused_logp.logp_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), 1.0, torch.ones(2), -100, True, True), r"token_temperature must have shape \[3\]"),
        (lambda: torch.ops.fused_logp.logp_entropy(torch.randn(8, 3).t(), torch.zeros(3, dtype=torch.long), 1.0, None, -100, True, True), "last dim must have stride 1, got stride 3"),
        (lambda: torch.ops.fused_logp.logp_entropy_backward(torch.ones(3), None, torch.randn(3, 8), torch.zeros(3, dtype=torch.long), 1.0, None, torch.zeros(3, 2), -100), "stats must be float64"),
        (lambda: torch.ops.fused_logp.logp_entropy_backward(torch.ones(2), None, torch.randn(3, 8), torch.zeros(3, dtype=torch.long), 1.0, None, torch.zeros(3, 2).double(), -100), r"grad_logp must have shape \[3\], got \[2\]"),
        (lambda: torch.ops.fused_logp.logp_entropy_backward(torch.ones(3), torch.ones(3, 1), torch.randn(3, 8), torch.zeros(3, dtype=torch.long), 1.0, None, torch.zeros(3, 2).double(), -100), r"grad_entropy must have shape \[3\]"),
    ],
)
def test_cpu_bad_arguments(call, match):
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        call()


def test_shape_contract():
    assert ops.unsupported_shape_reason(151936, 16384) is None
    assert ops.unsupported_shape_reason(1) is None
    assert "vocab_size is 0" in ops.unsupported_shape_reason(0) and ">= 1" in ops.unsupported_shape_reason(0)
    assert str(ops.MAX_VOCAB_SIZE) in ops.unsupported_shape_reason(ops.MAX_VOCAB_SIZE + 1)
    assert ops.unsupported_shape_reason(10, -1) is not None
    from prime_kernels_core.manifest import constants

    table = constants("prime_kernels_fused_logp", "fused_logp")
    assert ops.BLOCK_THREADS == table["BLOCK_THREADS"] and ops.MAX_VOCAB_SIZE == table["MAX_VOCAB_SIZE"]


# ---- conformance, opcheck / compile --------------------------------------------------------------------------------
def test_conforms():
    assert_conforms("fused_logp")


def _op_samples(device):
    samples = []
    for dtype, ent, tt, lab_dtype in [
        (torch.float32, True, False, torch.int64),
        (torch.bfloat16, True, True, torch.int32),
        (torch.float16, False, False, torch.int64),
    ]:
        n, v = 6, 37
        logits = make_logits(n, v, dtype, device).requires_grad_()
        labels = make_labels(n, v, device, dtype=lab_dtype)
        temp = torch.rand(n, device=device) + 0.5 if tt else None
        samples.append((logits, labels, 0.9, temp, -100, ent, True))
    logits = make_logits(6, 37, torch.bfloat16, device).requires_grad_()
    for softcap, scale in ((5.0, 1.0), (None, 0.25), (30.0, 0.5)):
        samples.append((logits, make_labels(6, 37, device), 0.9, None, -100, True, True, False, softcap, scale))
    return samples


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_opcheck(device):
    for args in _op_samples(device):
        torch.library.opcheck(torch.ops.fused_logp.logp_entropy.default, args)
        logits, labels, t, tt, ii, ent, _ = args[:7]
        tail = args[7:]  # batch_invariant, softcap, logit_scale when given
        x = logits.detach()
        _, _, stats = torch.ops.fused_logp.logp_entropy(x, labels, t, tt, ii, ent, True, *tail)
        n = x.shape[0]
        g_ent = torch.randn(n, device=device) if ent else None
        torch.library.opcheck(
            torch.ops.fused_logp.logp_entropy_backward.default,
            (torch.randn(n, device=device), g_ent, x, labels, t, tt, stats, ii, *tail),
        )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def f(x, y, t, **tf):
        lp, ent = logp_entropy(x, y, t, **tf)
        return lp.sum() * 0.5 + ent.sum()

    logits = make_logits(12, 97, torch.bfloat16, device).reshape(3, 4, 97)
    labels = make_labels(12, 97, device).reshape(3, 4)
    per_token = torch.rand(3, 4, device=device) + 0.5
    for t, tf in ((0.7, {}), (per_token, {}), (torch.tensor(0.7, device=device), {}),
                  (per_token, dict(softcap=5.0, logit_scale=0.5)), (0.7, dict(logit_scale=0.25))):
        f_tf = functools.partial(f, **tf)
        x1 = logits.clone().requires_grad_()
        x2 = logits.clone().requires_grad_()
        out_eager = f_tf(x1, labels, t)
        out_comp = torch.compile(f_tf, fullgraph=True, backend="aot_eager")(x2, labels, t)
        torch.testing.assert_close(out_comp, out_eager)
        out_eager.backward()
        out_comp.backward()
        torch.testing.assert_close(x2.grad, x1.grad)


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; none is visible")
class TestCUDA:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("kind", ["random", "peaked"])
    # Both paths' errors sit at the fp32 rounding floor, so a handful of rows makes the ratio a coin toss (8 rows of
    # 151936 failed once at 1.005x, 2 x 3 rows of 193 once, on an H200): every case has >= 64 rows. (64, 151936)
    # runs the split-vocab path; (4, 96, 193) a 3-D leading shape with odd V; (256, 32001) the vocab that is no
    # multiple of the tile (a scalar tail after the 16-byte vectors).
    @pytest.mark.parametrize("shape", [(256, 32001), (64, 257), (64, 151936), (1000, 151), (4, 96, 193)], ids=str)
    @pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
    def test_matches_float64(self, dtype, kind, shape, invariant):
        *lead, v = shape
        n = int(torch.tensor(lead).prod())
        logits = make_logits(n, v, dtype, "cuda", kind=kind).reshape(*lead, v)
        labels = make_labels(n, v, "cuda").reshape(*lead)
        check_against_float64(f"cuda {dtype} {kind} {shape} invariant={invariant}", logits, labels,
                              batch_invariant=invariant)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("kind", ["random", "peaked"])
    @pytest.mark.parametrize("softcap, logit_scale", TRANSFORMS, ids=str)
    @pytest.mark.parametrize("shape", [(256, 4099), (64, 151936)], ids=str)
    def test_logit_transforms(self, dtype, kind, softcap, logit_scale, shape):
        n, v = shape
        logits, labels = make_logits(n, v, dtype, "cuda", kind=kind), make_labels(n, v, "cuda")
        tag = f"cuda {dtype} {kind} {shape} softcap={softcap} logit_scale={logit_scale}"
        tf = dict(softcap=softcap, logit_scale=logit_scale)
        check_against_float64(f"{tag} T=0.7", logits, labels, 0.7, **tf)
        check_against_float64(f"{tag} per-token T", logits, labels, torch.rand(n, device="cuda") + 0.4, **tf)
        check_against_float64(f"{tag} invariant", logits, labels, 0.7, batch_invariant=True, **tf)
        # int32 labels (widened on the host for the softcap kernels) and odd-aligned rows (the gather path)
        check_against_float64(f"{tag} int32 labels", logits, labels.int(), 0.7, **tf)
        odd = make_logits(n, v + 1, dtype, "cuda", kind=kind)[:, 1:]
        check_against_float64(f"{tag} unaligned rows", odd, labels, 0.7, **tf)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_temperature(self, dtype):
        logits, labels = make_logits(128, 4099, dtype, "cuda"), make_labels(128, 4099, "cuda")
        check_against_float64(f"cuda {dtype} T=0.7", logits, labels, 0.7)
        per_token = (torch.rand(128, device="cuda") * 1.5 + 0.25).float()
        check_against_float64(f"cuda {dtype} per-token T", logits, labels, per_token)

    # v = 1031: rows of single vectors per thread; 40000: rows long enough for the forward's grouped path
    # (VEC_UNROLL vectors per max test), whose -inf / NaN fallback is then exercised too.
    @pytest.mark.parametrize("v", [1031, 40000])
    @pytest.mark.parametrize("tf", [{}, dict(softcap=5.0, logit_scale=0.5)], ids=["plain", "softcap"])
    def test_matches_cpu_and_edge_cases(self, v, tf):
        """NaN (that token NaN), all -inf, half -inf and +inf rows, int32 labels; with a softcap, -inf / +inf logits are
        -softcap / +softcap (finite results) and a NaN logit still makes its token NaN."""
        n = 64
        logits = make_logits(n, v, torch.bfloat16)
        labels = make_labels(n, v, dtype=torch.int32)
        logits[3, 5] = float("nan")
        logits[5] = float("-inf")
        logits[6, ::2] = float("-inf")
        labels[6] = 1
        labels[3] = 0  # the NaN row must not be an ignored token (make_labels ignores 20%)
        logits[7] = float("inf")
        cpu = logp_entropy(logits, labels, 1.3, **tf)
        cuda = logp_entropy(logits.cuda(), labels.cuda(), 1.3, **tf)
        for a, b in zip(cpu, cuda):
            torch.testing.assert_close(b.cpu(), a, equal_nan=True, rtol=2e-6, atol=2e-6)
        x_c = logits.clone().requires_grad_()
        x_g = logits.cuda().requires_grad_()
        g = torch.randn(n), torch.randn(n)
        torch.autograd.backward(logp_entropy(x_c, labels, 1.3, **tf), g)
        torch.autograd.backward(logp_entropy(x_g, labels.cuda(), 1.3, **tf), tuple(t.cuda() for t in g))
        torch.testing.assert_close(x_g.grad.cpu(), x_c.grad, equal_nan=True, rtol=1e-2, atol=1e-6)
        assert torch.isfinite(cuda[0][[0, 1, 2, 4, 6]]).all()
        assert torch.isnan(cuda[0][3]) and torch.isnan(cuda[1][3])
        if tf:
            assert torch.isfinite(cuda[0][[5, 7]]).all() and torch.isfinite(x_g.grad[[5, 7]]).all()

    def test_misaligned_rows_and_splits(self):
        for n, v, offset in [(3, 151936, 1), (5, 100003, 3), (1, 40000, 0), (300, 1001, 5)]:
            base = make_logits(n, v + 8, torch.bfloat16, "cuda")
            view = base[:, offset:offset + v]
            labels = make_labels(n, v, "cuda")
            labels[0] = v - 1
            check_against_float64(f"cuda strided {n}x{v}+{offset}", view, labels)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("tf", [{}, dict(softcap=30.0)], ids=["plain", "softcap"])
    def test_vocab_one_and_empty(self, tf, dtype):
        """V = 1: p = 1, logp = entropy = 0 exactly (the label's z is the one the sums saw: with a softcap, its float
        tanh), gradient 0."""
        x = (torch.randn(4, 1, device="cuda") * 10).to(dtype).requires_grad_()
        lp, ent = logp_entropy(x, torch.zeros(4, dtype=torch.long, device="cuda"), 0.7, **tf)
        assert (lp == 0).all() and (ent == 0).all()
        (lp.sum() + ent.sum()).backward()
        # z - sum p z is formed from float64 stats split into fp32 pairs: ~1e-16 residue instead of an exact 0
        torch.testing.assert_close(x.grad.float(), torch.zeros_like(x, dtype=torch.float32), rtol=0, atol=1e-12)
        x = torch.randn(0, 50, device="cuda", requires_grad=True)
        lp, ent = logp_entropy(x, torch.zeros(0, dtype=torch.long, device="cuda"), **tf)
        (lp.sum() + ent.sum()).backward()
        assert x.grad.shape == (0, 50)

    def test_bad_labels(self):
        logits = torch.randn(4, 10, 50, device="cuda")
        labels = torch.randint(0, 50, (4, 10), device="cuda")
        labels[2, 3] = 50
        labels[3, 0] = -7
        with pytest.raises(RuntimeError, match=r"labels\[23\] = 50 is out of range"):
            logp_entropy(logits, labels)
        lp, ent = logp_entropy(logits, labels, check_labels=False)  # no sync, no error: NaN for those tokens
        assert torch.isnan(lp[2, 3]) and torch.isnan(lp[3, 0]) and torch.isnan(ent[2, 3])
        assert torch.isfinite(lp[0]).all()

    def test_cuda_graph_capture(self):
        logits = make_logits(64, 3000, torch.bfloat16, "cuda")
        labels = make_labels(64, 3000, "cuda")
        eager = logp_entropy(logits, labels, check_labels=False)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            logp_entropy(logits, labels, check_labels=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = logp_entropy(logits, labels, check_labels=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
