"""flash_moe's families (activations, biases, weight layouts) and the pre-sorted entry: every output and gradient
against a float64 expert-by-expert reference on the same bf16 inputs, at most 1.5x the error of prime-rl's
grouped-mm formulation of the same family (reference.moe_grouped_mm: the PyTorch path the kernels replace). CPU
tests run everywhere; the ``@pytest.mark.gpu`` tests need CUDA and an sm_90a build. ``-s`` prints the ratios."""
from __future__ import annotations

import pytest
import torch

from prime_kernels_core.testing import assert_error_ratio, kernel_module
from prime_kernels_flash_moe import reference
from prime_kernels_flash_moe.layouts import ExpertLayout, join_pairs

KERNEL = "flash_moe"
ops = kernel_module(KERNEL, "prime_kernels_flash_moe.ops")
MAX_RATIO = 1.5
cpu = pytest.mark.kernel(KERNEL, device="cpu")
gpu = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]

# (activation, gate_up form, transposed, biases): the families trainers run (gpt-oss: interleaved, transposed, both
# biases; Nemotron-H: relu2), and each layout of each activation once
FAMILIES = [
    ("swiglu", "separate", False, ""), ("swiglu", "stacked", False, "b1"), ("swiglu", "interleaved", False, ""),
    ("swiglu", "stacked", True, "b2"), ("swiglu", "separate", True, ""),
    ("gpt_oss", "interleaved", True, "b1 b2"), ("gpt_oss", "stacked", False, "b1 b2"), ("gpt_oss", "separate", False, ""),
    ("relu2", "stacked", False, ""), ("relu2", "stacked", True, "b1 b2"),
]


def family_id(f):
    return f"{f[0]}-{f[1]}{'-T' if f[2] else ''}{'-' + f[3].replace(' ', '') if f[3] else ''}"


def make_family(T, dim, hidden, E, top_k, family, seed=0, ids=None, num_global=None, scale=1.0, device="cpu"):
    """(x, w1, w2, w3, b1, b2, ids, tw, layout) in the family's layout, from random gate / up / down weights."""
    activation, form, transposed, biases = family
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, dim, generator=g)).to(torch.bfloat16)
    gate = torch.randn(E, hidden, dim, generator=g) / dim**0.5
    up = torch.randn(E, hidden, dim, generator=g) / dim**0.5
    down = torch.randn(E, dim, hidden, generator=g) / hidden**0.5
    gated = activation != "relu2"
    if not gated:
        w1, w3 = gate, None
    elif form == "separate":
        w1, w3 = gate, up
    else:
        w1, w3 = join_pairs(gate, up, 1, form), None
    w2 = down
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        w3 = None if w3 is None else w3.transpose(1, 2).contiguous()
    b1 = 0.5 * torch.randn(E, (2 if gated else 1) * hidden, generator=g) if "b1" in biases else None
    b2 = 0.5 * torch.randn(E, dim, generator=g) if "b2" in biases else None
    if ids is None:
        ids = torch.stack([torch.randperm(num_global or E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, top_k, generator=g).softmax(-1)
    bf = [None if t is None else t.to(torch.bfloat16) for t in (w1, w2, w3, b1, b2)]
    layout = ExpertLayout(form if gated else "stacked", transposed)
    return [None if t is None else t.to(device) for t in (x, *bf, ids, tw)] + [layout]


NAMES = ("x", "w1", "w2", "w3", "b1", "b2", "topk_weights")


def check_family(problem, activation, label, expert_start=0, trainable=NAMES, deterministic=False):
    x, w1, w2, w3, b1, b2, ids, tw, layout = problem
    tensors = dict(x=x, w1=w1, w2=w2, w3=w3, b1=b1, b2=b2, topk_weights=tw)

    def leaves(dtype=None):
        return {n: None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(n in trainable)
                for n, t in tensors.items()}

    def run(fn, ls):
        return fn(ls["x"], ls["w1"], ls["w2"], ls["w3"], ids, ls["topk_weights"], expert_start=expert_start,
                  activation=activation, b1=ls["b1"], b2=ls["b2"], layout=layout)

    ours_l, base_l, ref_l = leaves(), leaves(), leaves(torch.float64)
    ours = run(lambda *a, **k: ops.moe(*a, deterministic=deterministic, **k), ours_l)
    base = run(reference.moe_grouped_mm, base_l)
    ref = run(reference.moe_per_expert, ref_l)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert_error_ratio(f"{label} forward", ours, base, ref, MAX_RATIO)
    names = [n for n in NAMES if n in trainable and tensors[n] is not None]
    if not names:
        return ours
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(x.device)
    grads = [torch.autograd.grad(o, [ls[n] for n in names], g)
             for o, ls, g in ((ours, ours_l, go), (base, base_l, go), (ref, ref_l, go.double()))]
    for name, a, b, r in zip(names, *grads):
        assert a.dtype == tensors[name].dtype and a.shape == tensors[name].shape, name
        if r.norm() == 0:
            assert a.abs().max() == 0, f"{label} grad {name} should be zero"
            continue
        assert_error_ratio(f"{label} grad {name}", a, b, r, MAX_RATIO)
    return ours


@cpu
@pytest.mark.parametrize("family", FAMILIES, ids=family_id)
def test_cpu_family_numerics(family):
    check_family(make_family(384, 128, 128, 4, 2, family, seed=11), family[0], f"cpu {family_id(family)}")


# the edge cases of the routing, on the families whose code paths differ most from SwiGLU's
EDGE_FAMILIES = [("gpt_oss", "interleaved", True, "b1 b2"), ("relu2", "stacked", False, "b1 b2")]


def edge_cases(family, device="cpu"):
    ids = torch.tensor([[0, 3], [3, 4], [4, 0]] * 86, dtype=torch.int32)[:256]
    cases = [("idle experts", make_family(256, 128, 128, 8, 2, family, seed=1, ids=ids, device=device), 0)]
    all_to_2 = torch.randint(0, 4, (300, 2), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    all_to_2[:, 0] = 2
    all_to_2[:, 1] = torch.where(all_to_2[:, 1] == 2, 0, all_to_2[:, 1])
    cases.append(("one expert takes all", make_family(300, 128, 128, 4, 2, family, seed=2, ids=all_to_2,
                                                      device=device), 0))
    cases.append(("M=1", make_family(1, 128, 128, 4, 2, family, seed=3, device=device), 0))
    ep = make_family(384, 128, 128, 4, 3, family, seed=4, num_global=8, device=device)
    ep[6] = ep[6].clone()
    ep[6][::5, 0] = -1
    cases.append(("EP experts [4,8) with -1", ep, 4))
    return cases


@cpu
@pytest.mark.parametrize("family", EDGE_FAMILIES, ids=family_id)
@pytest.mark.parametrize("case", range(4))
def test_cpu_family_edge_cases(family, case):
    label, problem, start = edge_cases(family)[case]
    check_family(problem, family[0], f"cpu {family_id(family)} {label}", expert_start=start)


@cpu
def test_cpu_gpt_oss_beyond_the_limit():
    """Pre-activations past +-limit: the clamps pass no gradient there (torch.clamp's rule), in ours as in the
    float64 reference; a large share of them is clamped."""
    family = ("gpt_oss", "interleaved", True, "b1 b2")
    problem = make_family(256, 128, 128, 4, 2, family, seed=5, scale=12.0)
    x, w1 = problem[0], problem[1]
    pre = x.float() @ w1[0].float()  # expert 0's gate | up (interleaved columns)
    assert (pre.abs() > ops.GPT_OSS_LIMIT).float().mean() > 0.2
    check_family(problem, "gpt_oss", "cpu gpt_oss beyond the limit")


@cpu
@pytest.mark.parametrize("family", EDGE_FAMILIES, ids=family_id)
def test_cpu_bias_only_gradients(family):
    """Frozen weights, trainable biases: the bias gradients alone (and x's), within the rule."""
    problem = make_family(256, 128, 128, 4, 2, family, seed=6)
    check_family(problem, family[0], f"cpu {family_id(family)} biases only", trainable=("b1", "b2"))


@cpu
def test_cpu_family_deterministic_is_bitwise():
    family = ("gpt_oss", "interleaved", True, "b1 b2")
    problem = make_family(200, 128, 128, 4, 2, family, seed=8)
    a, b = (check_family(problem, "gpt_oss", "cpu deterministic", deterministic=True) for _ in range(2))
    assert torch.equal(a, b)


def presorted(family, device="cpu", seed=9):
    """Rows grouped by expert with counts whose total leaves 10 padding rows at the end (an empty expert too)."""
    problem = make_family(160, 128, 128, 4, 1, family, seed=seed, device=device)
    counts = torch.tensor([40, 0, 70, 40], device=device)
    return problem, counts


@cpu
@pytest.mark.parametrize("family", EDGE_FAMILIES + [("swiglu", "separate", False, "")], ids=family_id)
def test_cpu_moe_sorted(family):
    """moe_sorted against prime-rl's pre-sorted formulation (experts_grouped_mm) and the float64 reference of the
    same rows, forward and every gradient; padding rows come back zero."""
    (x, w1, w2, w3, b1, b2, _, _, layout), counts = presorted(family)
    kw = dict(activation=family[0], b1=b1, b2=b2, layout=layout)
    tensors = dict(x=x, w1=w1, w2=w2, w3=w3, b1=b1, b2=b2)
    names = [n for n, t in tensors.items() if t is not None]

    def run(fn, dtype=None):
        ls = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in tensors.items() if t is not None}
        args = {n: ls.get(n) for n in tensors}
        out = fn(args["x"], args["w1"], args["w2"], args["w3"], counts, **{**kw, "b1": args["b1"], "b2": args["b2"]})
        return out, [ls[n] for n in names]

    ours, ours_l = run(ops.moe_sorted)
    base, base_l = run(reference.experts_grouped_mm)
    expert = torch.repeat_interleave(torch.arange(4), counts)
    ids = torch.cat([expert, torch.full((x.shape[0] - expert.numel(),), -1)]).to(torch.int32).unsqueeze(1)
    ref, ref_l = run(lambda x, w1, w2, w3, counts, **k: reference.moe_per_expert(
        x, w1, w2, w3, ids, torch.ones(x.shape[0], 1, dtype=torch.float64), **k), torch.float64)
    assert torch.equal(ours[150:], torch.zeros_like(ours[150:]))
    assert_error_ratio(f"moe_sorted {family_id(family)} forward", ours, base, ref, MAX_RATIO)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for name, a, b, r in zip(names, torch.autograd.grad(ours, ours_l, go), torch.autograd.grad(base, base_l, go),
                             torch.autograd.grad(ref, ref_l, go.double())):
        assert_error_ratio(f"moe_sorted {family_id(family)} grad {name}", a, b, r, MAX_RATIO)


@cpu
def test_cpu_moe_sorted_row_weights_and_float_counts():
    """torchtitan's histc counts are float; row_weights multiply each row's output (routing scores after the
    experts), as moe()'s topk_weights do."""
    family = ("swiglu", "separate", False, "")
    (x, w1, w2, w3, *_), counts = presorted(family)
    weights = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(4))
    plain = ops.moe_sorted(x, w1, w2, w3, counts.float())
    weighted = ops.moe_sorted(x, w1, w2, w3, counts, row_weights=weights)
    torch.testing.assert_close(weighted.float(), (plain.float() * weights[:, None]), rtol=1e-2, atol=1e-2)


@cpu
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layout=ExpertLayout("interleaved")), r"moe: layout gate_up='interleaved' needs w3 None"),
        (dict(w3=None, layout=ExpertLayout("separate")), r"moe: layout gate_up='separate' needs w3 \(the up"),
        (dict(activation="relu2"), r"moe: w3 must be None for activation 'relu2'"),
        (dict(activation="gelu"), r"moe: activation must be 'swiglu', 'gpt_oss' or 'relu2', got 'gelu'"),
        (dict(activation="gpt_oss", limit=-1.0), r"activation 'gpt_oss' needs a finite alpha and a finite positive"),
        (dict(layout="interleaved"), r"moe: layout must be an ExpertLayout or None, got str"),
        (dict(b1=torch.zeros(4, 128, dtype=torch.bfloat16)), r"moe: b1 must have shape \(E, 2 hidden\) = \(4, 256\), "
                                                            r"got \(4, 128\)"),
        (dict(b2=torch.zeros(4, 64, dtype=torch.bfloat16)), r"moe: b2 must have shape \(E, dim\) = \(4, 128\)"),
        (dict(b2=torch.zeros(4, 128)), r"moe: b2 must be bfloat16, got torch.float32"),
        (dict(layout=ExpertLayout("separate", transposed=True)), r"moe: w1 must be 3-D \(E, dim, hidden\) with dim = "
                                                                 r"x's last dimension, got w1 of shape \(4, 128, 96\)"),
        (dict(deterministic=torch.tensor(True)), r"moe: deterministic must be a bool, got Tensor"),
    ],
)
def test_cpu_family_argument_errors(change, message):
    """A layout that does not match the tensors, a wrong bias or an unknown activation: one sentence naming both."""
    x, w1, w2, w3, _, _, ids, tw, _ = make_family(16, 128, 128, 4, 2, ("swiglu", "separate", False, ""), seed=12)
    args = dict(x=x, w1=w1, w2=w2, w3=w3, topk_ids=ids, topk_weights=tw)
    if change.get("layout") == ExpertLayout("separate", transposed=True):
        args["x"] = torch.randn(16, 96).to(torch.bfloat16)
        args["w1"] = w1[:, :, :96]
    args.update(change)
    with pytest.raises((RuntimeError, TypeError), match=message):
        ops.moe(**args)


@cpu
def test_cpu_moe_sorted_argument_errors():
    family = ("swiglu", "separate", False, "")
    (x, w1, w2, w3, *_), counts = presorted(family)
    with pytest.raises(RuntimeError, match=r"moe_sorted: num_tokens_per_expert must be a 1-D real tensor of one count "
                                           r"per local expert \(w1's first dimension 4\)"):
        ops.moe_sorted(x, w1, w2, w3, counts[:3])
    with pytest.raises(TypeError, match="moe_sorted: expert_start does not apply"):
        ops.moe_sorted(x, w1, w2, w3, counts, expert_start=2)
    with pytest.raises(RuntimeError, match=r"moe_sorted: row_weights must be a floating-point tensor of shape"):
        ops.moe_sorted(x, w1, w2, w3, counts, row_weights=torch.ones(3))


@pytest.mark.parametrize("family", FAMILIES, ids=family_id)
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_family_numerics(family):
    """On CUDA, the fused kernels of each family within the rule (biases, the clamps, relu2's whole-tile epilogue)."""
    problem = make_family(4096, 256, 256, 8, 2, family, seed=21, device="cuda")
    check_family(problem, family[0], f"cuda {family_id(family)}")
