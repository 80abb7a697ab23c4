"""flash_moe with LoRA adapters (moe(lora=MoeLora(...)), issue 58): every output and gradient against a float64
reference on the same bf16 inputs (reference.moe_per_expert with the adapters), at most 1.5x the error of prime-rl's
unfused formulation (reference.moe_lora_grouped_mm: base grouped GEMMs plus x A^T, then (.) B^T, scaled, per
adapter); several adapters in one call, every family and layout, expert parallelism, moe_sorted, the frozen base's
skipped weight-gradient GEMMs, compile, argument errors, and the per-expert naming helpers. CPU tests run everywhere
(``-s`` prints the ratios); the ``@pytest.mark.gpu`` tests run the same checks on CUDA, where the ops are fused
(csrc/cuda/fused_moe_sm90.cu), and compare each fused op with the CPU op (the definition of the numerics) against
float64."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prime_kernels_core.testing import assert_error_ratio, kernel_module
from prime_kernels_flash_moe import reference
from prime_kernels_flash_moe.layouts import ExpertLayout, join_pairs

KERNEL = "flash_moe"
ops = kernel_module(KERNEL, "prime_kernels_flash_moe.ops")
MAX_RATIO = 1.5
cpu = pytest.mark.kernel(KERNEL, device="cpu")
gpu = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]
ADAPTERS = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")
BASE = ("w1", "w2", "w3")


def make_problem(T, dim, hidden, E, top_k, family, seed=0, num_global=None, device="cpu"):
    """dict(x, w1, w2, w3, b1, b2, ids, tw) in the family's (activation, gate_up form, transposed, biases) layout,
    and the ExpertLayout."""
    activation, form, transposed, biases = family
    g = torch.Generator().manual_seed(seed)
    gated = activation != "relu2"
    gate, up = (torch.randn(E, hidden, dim, generator=g) / dim**0.5 for _ in range(2))
    w2 = torch.randn(E, dim, hidden, generator=g) / hidden**0.5
    w1, w3 = (gate, None) if not gated else (gate, up) if form == "separate" else (join_pairs(gate, up, 1, form), None)
    if transposed:
        w1, w2, w3 = (None if w is None else w.transpose(1, 2).contiguous() for w in (w1, w2, w3))
    t = dict(x=torch.randn(T, dim, generator=g), w1=w1, w2=w2, w3=w3,
             b1=0.5 * torch.randn(E, (2 if gated else 1) * hidden, generator=g) if "b1" in biases else None,
             b2=0.5 * torch.randn(E, dim, generator=g) if "b2" in biases else None)
    t = {k: None if v is None else v.to(torch.bfloat16).to(device) for k, v in t.items()}
    t["ids"] = torch.stack([torch.randperm(num_global or E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    t["tw"] = torch.rand(T, top_k, generator=g).softmax(-1)
    t["ids"], t["tw"] = t["ids"].to(device), t["tw"].to(device)
    return t, ExpertLayout(form if gated else "stacked", transposed)


def make_lora(n, E, dim, hidden, rank, gated=True, seed=1, zero_b=False, device="cpu", adapter_ids=None,
              projections=("gate", "up", "down")):
    """n adapters on each of ``projections`` (A ~ 1/sqrt(in), B ~ 1/sqrt(r): terms as large as the base's), scalings
    0.5 ... 2.0."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, n_in, n_out in (("gate", dim, hidden), ("up", dim, hidden), ("down", hidden, dim)):
        if (proj == "up" and not gated) or proj not in projections:
            continue
        tensors[f"a_{proj}"] = torch.randn(n, E, rank, n_in, generator=g) / n_in**0.5
        tensors[f"b_{proj}"] = torch.randn(n, E, n_out, rank, generator=g) / rank**0.5 * (0 if zero_b else 1)
    tensors = {k: v.to(torch.bfloat16).to(device) for k, v in tensors.items()}
    return ops.MoeLora(torch.linspace(0.5, 2.0, n).to(device), **tensors, adapter_ids=adapter_ids)


def run_all(t, layout, activation, lora, trainable, expert_start=0, call=None, **constants):
    """(ours, prime-rl's, float64) outputs and the gradients of ``trainable`` (names of t and of the adapters);
    ``constants``: the activation's (alpha, limit), for every path."""
    def leaves(dtype=None):
        ls = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_(k in trainable)
              for k, v in t.items() if k != "ids"}
        pairs = {k: None if v is None else v.detach().to(dtype or v.dtype).requires_grad_(k in trainable)
                 for k, v in zip(ADAPTERS, lora.adapters())}
        return ls, ops.MoeLora(lora.scaling, **pairs, adapter_ids=lora.adapter_ids)

    def run(fn, ls, lr):
        return fn(ls["x"], ls["w1"], ls["w2"], ls["w3"], t["ids"], ls["tw"], expert_start, activation=activation,
                  b1=ls["b1"], b2=ls["b2"], layout=layout, lora=lr, **constants)

    ours_fn = call or (lambda x, w1, w2, w3, ids, tw, start, **k: ops.moe(x, w1, w2, w3, ids, tw, expert_start=start,
                                                                           **k))
    results = []
    paths = ((ours_fn, None), (reference.moe_lora_grouped_mm, None), (reference.moe_per_expert, torch.float64))
    for fn, dtype in paths:
        ls, lr = leaves(dtype)
        out = run(fn, ls, lr)
        named = {**ls, **dict(zip(ADAPTERS, lr.adapters()))}
        names = [n for n in trainable if named.get(n) is not None]
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(out.device)
        grads = torch.autograd.grad(out, [named[n] for n in names], go.to(out.dtype)) if names else ()
        results.append((out, dict(zip(names, grads))))
    return results


def check(label, results, inputs):
    (ours, ours_g), (base, base_g), (ref, ref_g) = results
    assert ours.dtype == torch.bfloat16
    assert_error_ratio(f"{label} forward", ours, base, ref, MAX_RATIO)
    for name, r in ref_g.items():
        a = ours_g[name]
        assert a.dtype == inputs[name].dtype and a.shape == inputs[name].shape, name
        if r.norm() == 0:
            assert a.abs().max() == 0, f"{label} grad {name} should be zero"
            continue
        assert_error_ratio(f"{label} grad {name}", a, base_g[name], r, MAX_RATIO)


def inputs_of(t, lora):
    return {**{k: v for k, v in t.items() if v is not None}, **{k: v for k, v in zip(ADAPTERS, lora.adapters())
                                                                 if v is not None}}


# (n_adapters, rank, family): 1, 2 and 4 adapters, ranks 8 / 16 / 64, each activation, each layout, biases
CASES = [
    (1, 8, ("swiglu", "separate", False, "")),
    (2, 16, ("swiglu", "stacked", False, "b1")),
    (4, 64, ("swiglu", "separate", False, "")),
    (2, 16, ("swiglu", "interleaved", True, "b2")),
    (2, 16, ("gpt_oss", "interleaved", True, "b1 b2")),
    (4, 8, ("gpt_oss", "stacked", False, "")),
    (2, 8, ("relu2", "stacked", True, "b1 b2")),
    (1, 64, ("relu2", "stacked", False, "")),
]


def case_id(case):
    n, r, f = case
    return f"n{n}-r{r}-{f[0]}-{f[1]}{'-T' if f[2] else ''}{'-' + f[3].replace(' ', '') if f[3] else ''}"


@cpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cpu_lora_numerics(case):
    """Frozen base weights (the LoRA setting): x, topk_weights, the biases and every A and B."""
    n, rank, family = case
    t, layout = make_problem(256, 128, 128, 4, 2, family, seed=11)
    adapter_ids = torch.randint(0, n, (256,), generator=torch.Generator().manual_seed(3))
    lora = make_lora(n, 4, 128, 128, rank, family[0] != "relu2", adapter_ids=adapter_ids)
    trainable = ("x", "tw", "b1", "b2", *ADAPTERS)
    check(f"cpu {case_id(case)}", run_all(t, layout, family[0], lora, trainable), inputs_of(t, lora))


@cpu
def test_cpu_lora_trainable_base_and_recompute():
    """Base weights trained too (their gradients through the same backward), and recompute_gate_up gives the same
    gradients bitwise (moe_lora_gate_up recomputes g | u and the rank-r rows exactly)."""
    family = ("swiglu", "stacked", False, "b1 b2")
    t, layout = make_problem(192, 128, 128, 4, 2, family, seed=5)
    lora = make_lora(2, 4, 128, 128, 16, adapter_ids=torch.arange(192) % 2)
    trainable = ("x", "tw", "w1", "w2", "b1", "b2", *ADAPTERS)
    saved = run_all(t, layout, "swiglu", lora, trainable)
    check("cpu trainable base", saved, inputs_of(t, lora))
    recompute = run_all(t, layout, "swiglu", lora, trainable,
                        call=lambda *a, **k: ops.moe(*a[:6], expert_start=a[6], recompute_gate_up=True, **k))
    assert torch.equal(saved[0][0], recompute[0][0])
    for name, grad in saved[0][1].items():
        assert torch.equal(grad, recompute[0][1][name]), name


@cpu
@pytest.mark.parametrize("n", [1, 3])
def test_cpu_lora_zero_b_is_the_base_bitwise(n):
    zero_b_is_the_base_bitwise(n, "cpu")


def zero_b_is_the_base_bitwise(n, device):
    """Fresh adapters (B = 0, PEFT's initialisation): the output is the base call's, bitwise (top_k 2: the two fp32
    atomic adds of a token on CUDA commute); the B gradients are not zero (training starts)."""
    family = ("gpt_oss", "interleaved", True, "b1 b2")
    t, layout = make_problem(200, 128, 128, 4, 2, family, seed=2, device=device)
    lora = make_lora(n, 4, 128, 128, 16, zero_b=True, device=device, adapter_ids=(torch.arange(200) % n).to(device))
    for name in ("b_gate", "b_up", "b_down"):
        getattr(lora, name).requires_grad_(True)
    kw = dict(activation="gpt_oss", b1=t["b1"], b2=t["b2"], layout=layout)
    base = ops.moe(t["x"], t["w1"], t["w2"], t["w3"], t["ids"], t["tw"], **kw)
    ours = ops.moe(t["x"], t["w1"], t["w2"], t["w3"], t["ids"], t["tw"], lora=lora, **kw)
    assert torch.equal(ours, base)
    grads = torch.autograd.grad(ours.float().square().sum(), [lora.b_gate, lora.b_up, lora.b_down])
    assert all(g.abs().sum() > 0 and g.isfinite().all() for g in grads)


@cpu
def test_cpu_lora_adapter_without_tokens():
    adapter_without_tokens("cpu")


def adapter_without_tokens(device):
    """Adapter 1 of 3 gets no token: its gradients are exactly zero, the others within the rule."""
    family = ("swiglu", "separate", False, "")
    t, layout = make_problem(160, 128, 128, 4, 2, family, seed=4, device=device)
    lora = make_lora(3, 4, 128, 128, 8, device=device,
                     adapter_ids=torch.where(torch.arange(160) % 2 == 0, 0, 2).to(device))
    results = run_all(t, layout, "swiglu", lora, ("x", "tw", *ADAPTERS))
    check(f"{device} adapter without tokens", results, inputs_of(t, lora))
    for name in ADAPTERS:
        assert torch.count_nonzero(results[0][1][name][1]) == 0, name
        assert torch.count_nonzero(results[0][1][name][0]) > 0, name


@cpu
@pytest.mark.parametrize("unrouted", [-1, 8], ids=["minus-one", "num-experts"])
def test_cpu_lora_expert_parallel(unrouted):
    expert_parallel(unrouted, "cpu")


def expert_parallel(unrouted, device, family=("relu2", "stacked", False, "b1 b2")):
    """Local experts [4, 8) of 8, some slots unrouted (-1, or transformers' id == num_experts)."""
    t, layout = make_problem(256, 128, 128, 4, 3, family, seed=6, num_global=8, device=device)
    t["ids"] = t["ids"].clone()
    t["ids"][::5, 0] = unrouted
    gated = family[0] != "relu2"
    lora = make_lora(2, 4, 128, 128, 16, gated=gated, device=device, adapter_ids=(torch.arange(256) % 2).to(device))
    results = run_all(t, layout, family[0], lora, ("x", "tw", "b1", "b2", *ADAPTERS), expert_start=4,
                      call=lambda *a, **k: ops.moe(*a[:6], expert_start=a[6], num_experts=8, **k))
    check(f"{device} EP unrouted={unrouted} {family[0]}", results, inputs_of(t, lora))


@cpu
def test_cpu_lora_moe_sorted():
    """moe_sorted with one adapter per row: as moe() with each row's expert and weight."""
    family = ("swiglu", "stacked", False, "b1")
    t, layout = make_problem(240, 128, 128, 4, 1, family, seed=8)
    counts = torch.tensor([70, 0, 90, 60])  # 220 counted rows, 20 of padding
    expert = torch.repeat_interleave(torch.arange(4), counts)
    t["ids"] = torch.cat([expert, torch.full((20,), -1)]).to(torch.int32).unsqueeze(1)
    lora = make_lora(2, 4, 128, 128, 16, adapter_ids=torch.arange(240) % 2)

    def sorted_call(x, w1, w2, w3, ids, tw, start, **k):
        return ops.moe_sorted(x, w1, w2, w3, counts, row_weights=tw[:, 0], **k)

    results = run_all(t, layout, "swiglu", lora, ("x", "tw", "b1", *ADAPTERS), call=sorted_call)
    check("cpu moe_sorted", results, inputs_of(t, lora))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((str(func.overloadpacket), out))
        return out


@cpu
@pytest.mark.parametrize("trainable_base", [False, True], ids=["frozen-base", "trainable-base"])
def test_cpu_lora_frozen_base_skips_weight_gradients(trainable_base):
    """The backward runs one weight-gradient GEMM per adapter tensor (shaped like it) and, only when the base weights
    require grad, one per base weight; no other GEMM of base-weight size."""
    family = ("swiglu", "separate", False, "")
    t, layout = make_problem(64, 128, 128, 4, 2, family, seed=9)
    lora = make_lora(2, 4, 128, 128, 16, adapter_ids=torch.arange(64) % 2)
    weights = [t[k].requires_grad_(trainable_base) for k in BASE]
    adapters = [a.requires_grad_() for a in lora.adapters()]
    out = ops.moe(t["x"], *weights, t["ids"], t["tw"], lora=lora)
    with OpCounter() as counter:
        out.float().square().sum().backward()
    grad_weight = [o for name, o in counter.calls if name == "flash_moe.moe_grad_weight"]
    base_sized = [o for name, o in counter.calls if name in ("aten._grouped_mm", "aten.bmm")]
    assert len(grad_weight) == 6 + (3 if trainable_base else 0)
    assert not base_sized
    adapter_groups = {(8, *a.shape[2:]) for a in adapters}  # (E * n_adapters, ...) per (expert, adapter) group
    shapes = sorted(tuple(o.shape) for o in grad_weight)
    assert sum(s in adapter_groups for s in shapes) == 6, shapes
    assert all(w.grad is not None for w in weights) == trainable_base
    assert all(a.grad is not None and a.grad.dtype == torch.bfloat16 for a in adapters)


@cpu
def test_cpu_lora_compile_fullgraph():
    """torch.compile(fullgraph=True): output and every gradient as eager, bitwise (the same ops)."""
    family = ("gpt_oss", "interleaved", True, "b1 b2")
    t, layout = make_problem(48, 64, 64, 3, 2, family, seed=12)
    lora = make_lora(2, 3, 64, 64, 8, adapter_ids=torch.arange(48) % 2)

    def fn(x, tw, adapter_ids, *adapters):
        return ops.moe(x, t["w1"], t["w2"], None, t["ids"], tw, activation="gpt_oss", b1=t["b1"], b2=t["b2"],
                       layout=layout, lora=ops.MoeLora(lora.scaling, *adapters, adapter_ids=adapter_ids))

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        leaves = [t["x"].clone().requires_grad_(), t["tw"].clone().requires_grad_()]
        adapters = [a.clone().requires_grad_() for a in lora.adapters()]
        out = run(*leaves, lora.adapter_ids, *adapters)
        results.append((out, torch.autograd.grad(out.float().square().sum(), leaves + adapters)))
    assert torch.equal(results[0][0], results[1][0])
    for eager, compiled in zip(results[0][1], results[1][1]):
        assert torch.equal(eager, compiled)


def bad_lora(change):
    """A valid 2-adapter problem with one change applied: (t, lora, kwargs)."""
    t, layout = make_problem(16, 64, 64, 3, 2, ("swiglu", "separate", False, ""), seed=13)
    lora = make_lora(2, 3, 64, 64, 8, adapter_ids=torch.arange(16) % 2)
    fields = dict(zip(ADAPTERS, lora.adapters()), scaling=lora.scaling, adapter_ids=lora.adapter_ids)
    kwargs = {}
    change(fields, kwargs)
    return t, ops.MoeLora(**fields), kwargs


BAD = [
    (lambda f, k: f.update(b_gate=f["b_gate"][..., :4].contiguous()), "b_gate must have shape (n_adapters, E, out, r)"),
    (lambda f, k: f.update(a_up=f["a_up"][:, :, :4].contiguous(), b_up=f["b_up"][..., :4].contiguous()),
     "a_up's rank (third dimension) must be a positive multiple of LORA_RANK_ALIGN=8, got 4"),
    (lambda f, k: f.update(a_down=f["a_down"].float()), "a_down must be bfloat16"),
    (lambda f, k: f.update(b_down=None), "a_down and b_down must both be tensors"),
    (lambda f, k: f.update(a_gate=f["a_gate"][:, :2].contiguous()),
     "a_gate must have shape (n_adapters, E, r, in) = (2, 3, r, 64)"),
    (lambda f, k: f.update(a_gate=f["a_gate"][..., :32].contiguous()), "a_gate must have shape"),
    (lambda f, k: f.update(scaling=torch.ones(3)), "a_gate must have shape (n_adapters, E, r, in) = (3, 3"),
    (lambda f, k: f.update(scaling=torch.ones(2, 1)), "lora.scaling must be a 1-D float tensor"),
    (lambda f, k: f.update(scaling="2"), "lora.scaling must be a float"),
    (lambda f, k: f.update(adapter_ids=torch.full((16,), 2)), "lora.adapter_ids must be in [0, n_adapters=2)"),
    (lambda f, k: f.update(adapter_ids=torch.full((16,), -1)), "lora.adapter_ids must be in [0, n_adapters=2)"),
    (lambda f, k: f.update(adapter_ids=torch.zeros(15, dtype=torch.long)), "lora.adapter_ids must be int32 or int64"),
    (lambda f, k: f.update(adapter_ids=torch.zeros(16)), "lora.adapter_ids must be int32 or int64"),
    (lambda f, k: f.update(a_gate=[1]), "lora.a_gate must be a torch.Tensor"),
    (lambda f, k: k.update(mxfp8=True), "LoRA adapters run on the bf16 path only"),
    (lambda f, k: f.update(scaling=torch.ones(400), **{n: None for n in ADAPTERS}),
     "E_local * n_adapters = 3 * 400 = 1200 (expert, adapter) groups, at most MAX_EXPERTS=1024"),
]


@cpu
@pytest.mark.parametrize("case", range(len(BAD)))
def test_cpu_lora_argument_errors(case):
    change, message = BAD[case]
    t, lora, kwargs = bad_lora(change)
    with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
        ops.moe(t["x"], t["w1"], t["w2"], t["w3"], t["ids"], t["tw"], lora=lora, **kwargs)
    assert message in str(info.value), str(info.value)


@cpu
def test_cpu_lora_relu2_refuses_up_adapters():
    t, layout = make_problem(16, 64, 64, 3, 2, ("relu2", "stacked", False, ""), seed=14)
    lora = make_lora(1, 3, 64, 64, 8)
    with pytest.raises(RuntimeError, match=r"a_up and b_up must be None without w3 \(activation 'relu2'"):
        ops.moe(t["x"], t["w1"], t["w2"], None, t["ids"], t["tw"], activation="relu2", lora=lora)


@cpu
def test_cpu_lora_expert_ids_still_checked():
    t, _ = make_problem(16, 64, 64, 3, 2, ("swiglu", "separate", False, ""), seed=15)
    t["ids"][3, 1] = 7
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, num_experts=3\)"):
        ops.moe(t["x"], t["w1"], t["w2"], t["w3"], t["ids"], t["tw"], lora=make_lora(1, 3, 64, 64, 8))


@cpu
def test_cpu_lora_shape_contract():
    assert ops.unsupported_shape_reason(2048, 768, lora_rank=16, n_adapters=4, num_local_experts=128) is None
    assert "multiple of 8, got 12" in ops.unsupported_shape_reason(2048, 768, lora_rank=12)
    assert "at most 1024, got 128 * 16 = 2048" in ops.unsupported_shape_reason(2048, 768, lora_rank=16,
                                                                               n_adapters=16, num_local_experts=128)
    assert "bf16 path only" in ops.unsupported_shape_reason(2048, 768, lora_rank=16, mxfp8=True)
    assert "multiple of 64" in ops.unsupported_shape_reason(2000, 768, lora_rank=16)


@cpu
@pytest.mark.parametrize("prefix", ["", "base_model.model.model.layers.3.mlp.experts"])
def test_cpu_lora_naming_round_trip(prefix):
    """export_adapter -> load_adapter gives the adapter back exactly, keys in prime-rl's (no prefix) and PEFT / vLLM's
    (the experts module's path) per-expert naming, global expert indices under expert parallelism."""
    lora = make_lora(3, 4, 64, 128, 8)
    state = export_adapter_checked(lora, 1, prefix, expert_start=4)
    loaded = ops.load_adapter({**state, "other.weight": torch.ones(1)}, 4, 1.25, prefix, expert_start=4)
    assert loaded.scaling == 1.25 and loaded.n_adapters() == 1
    for name, original in zip(ADAPTERS, lora.adapters()):
        assert torch.equal(getattr(loaded, name)[0], original[1]), name
    stacked = ops.stack_adapters([loaded, ops.MoeLora(0.5, **{n: getattr(lora, n)[2:] for n in ADAPTERS})])
    assert stacked.n_adapters() == 2 and torch.equal(stacked.a_gate[1], lora.a_gate[2])


def export_adapter_checked(lora, adapter, prefix, expert_start):
    state = ops.export_adapter(lora, adapter, prefix, expert_start=expert_start)
    head = f"{prefix}." if prefix else ""
    assert len(state) == 4 * 3 * 2
    assert state[f"{head}5.gate_proj.lora_A.weight"].shape == (8, 64)  # (r, in)
    assert state[f"{head}7.down_proj.lora_B.weight"].shape == (64, 8)  # (out, r)
    assert torch.equal(state[f"{head}6.up_proj.lora_B.weight"], lora.b_up[adapter, 2])
    return state


@cpu
def test_cpu_lora_naming_errors_and_rank_padding():
    lora = make_lora(1, 2, 64, 64, 8)
    state = ops.export_adapter(lora)
    del state["1.up_proj.lora_B.weight"]
    with pytest.raises(ValueError, match=r"up_proj has an adapter but no 1\.up_proj\.lora_B\.weight"):
        ops.load_adapter(state, 2, 1.0)
    with pytest.raises(ValueError, match="no key"):
        ops.load_adapter({}, 2, 1.0)
    small, large = make_lora(1, 2, 64, 64, 8, seed=3), make_lora(1, 2, 64, 64, 16, seed=4)
    both = ops.stack_adapters([small, large], adapter_ids=torch.tensor([0, 1, 1]))
    assert both.a_gate.shape == (2, 2, 16, 64) and torch.count_nonzero(both.a_gate[0, :, 8:]) == 0
    # zero padding adds nothing: the padded adapter computes what the rank-8 one does
    t, _ = make_problem(3, 64, 64, 2, 1, ("swiglu", "separate", False, ""), seed=5)
    t["ids"] = torch.zeros(3, 1, dtype=torch.int32)
    args = (t["x"][:1], t["w1"], t["w2"], t["w3"], t["ids"][:1], t["tw"][:1])
    padded = ops.MoeLora(both.scaling[:1], **{n: getattr(both, n)[:1] for n in ADAPTERS})
    torch.testing.assert_close(ops.moe(*args, lora=padded), ops.moe(*args, lora=small))


# (T, dim, hidden, E, top_k): whole tiles; then partial column tiles in both GEMMs (hidden 192, dim 320), top_k 3
GPU_SHAPES = [(1024, 256, 256, 8, 2), (600, 320, 192, 5, 3)]


# gpt_oss's clamps out of reach: where |u| nears the limit, a gradient's error is a count of the elements whose bf16
# rounding crosses it (the clamp's gradient is discontinuous there), noise that sets the ratio to prime-rl's path for
# the CPU definition itself: up to 3.0 (b_up, n4-r8-gpt_oss-stacked) at 1024x256x256x8x2 with the limit at 7, 0.6-0.7
# with it at 1e4 (measured on the CPU ops). The clamps' own rule is checked against the CPU definition instead.
OUT_OF_REACH = {"limit": 1e4}


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_numerics(case, shape):
    """The same rule on CUDA: the fused forward (every family and weight form: the extension's halves, relu2's whole
    tiles, gpt-oss's pairs; ranks 8 / 16 / 64, 1 / 2 / 4 adapters) and backward; gpt_oss with its clamps out of reach
    (OUT_OF_REACH), and with them against the CPU definition on the same inputs."""
    n, rank, family = case
    T, dim, hidden, E, top_k = shape
    t, layout = make_problem(T, dim, hidden, E, top_k, family, seed=11, device="cuda")
    adapter_ids = torch.randint(0, n, (T,), generator=torch.Generator().manual_seed(3)).cuda()
    lora = make_lora(n, E, dim, hidden, rank, family[0] != "relu2", device="cuda", adapter_ids=adapter_ids)
    trainable = ("x", "tw", "b1", "b2", *ADAPTERS)
    constants = OUT_OF_REACH if family[0] == "gpt_oss" else {}
    check(f"gpu {case_id(case)} {shape}", run_all(t, layout, family[0], lora, trainable, **constants),
          inputs_of(t, lora))
    if family[0] == "gpt_oss":
        cpu_lora = ops.MoeLora(lora.scaling.cpu(), *[None if a is None else a.cpu() for a in lora.adapters()],
                               adapter_ids=adapter_ids.cpu())
        cpu_t = {k: None if v is None else v.cpu() for k, v in t.items()}
        ours = run_all(t, layout, family[0], lora, trainable)
        definition = run_all(cpu_t, layout, family[0], cpu_lora, trainable)
        check_against_definition(f"gpu {case_id(case)} {shape} clamps", ours, definition)


def check_against_definition(label, ours, definition):
    """ours (CUDA) within 1.5x the CPU definition's error against float64, output and every gradient."""
    (out, grads), _, (ref, ref_grads) = ours
    (cpu_out, cpu_grads), _, _ = definition
    assert_error_ratio(f"{label} forward", out.cpu(), cpu_out, ref.cpu(), MAX_RATIO)
    for name, r in ref_grads.items():
        if r.norm() > 0:
            assert_error_ratio(f"{label} grad {name}", grads[name].cpu(), cpu_grads[name], r.cpu(), MAX_RATIO)


SUBSETS = [("gate",), ("up",), ("down",), ("gate", "down"), ("up", "down"), ("gate", "up")]


@pytest.mark.parametrize("projections", SUBSETS, ids="-".join)
@pytest.mark.parametrize("family", [("swiglu", "separate", False, "b1"), ("gpt_oss", "interleaved", True, "b1 b2")],
                         ids=lambda f: f[0])
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_some_projections(projections, family):
    """Adapters on some projections only: a gate/up tile's half without an adapter reads zeros (its B at a column
    shift past every column); gpt-oss's pairs get zero rows for the absent half (its clamps out of reach:
    OUT_OF_REACH)."""
    t, layout = make_problem(512, 256, 192, 4, 2, family, seed=21, device="cuda")
    lora = make_lora(2, 4, 256, 192, 16, device="cuda", projections=projections,
                     adapter_ids=(torch.arange(512) % 2).cuda())
    constants = OUT_OF_REACH if family[0] == "gpt_oss" else {}
    check(f"gpu {family[0]} {'+'.join(projections)}",
          run_all(t, layout, family[0], lora, ("x", "tw", *[a for a in ADAPTERS if a[2:] in projections]),
                  **constants),
          inputs_of(t, lora))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_zero_b_is_the_base_bitwise(n):
    zero_b_is_the_base_bitwise(n, "cuda")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_adapter_without_tokens():
    adapter_without_tokens("cuda")


@pytest.mark.parametrize("family", [("relu2", "stacked", False, "b1 b2"), ("swiglu", "stacked", True, "b2")],
                         ids=lambda f: f[0])
@pytest.mark.parametrize("unrouted", [-1, 8], ids=["minus-one", "num-experts"])
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_expert_parallel(unrouted, family):
    expert_parallel(unrouted, "cuda", family)


def op_arguments(t, layout, activation, lora, deterministic):
    """moe_lora_forward's arguments as moe() forms them (the weights' views, the (expert, adapter) groups and their
    alignment, computed on the CPU), on t's device; and the groups."""
    family = ops.make_family(activation, ops.GPT_OSS_ALPHA, ops.GPT_OSS_LIMIT, layout, t["w3"])
    gate, up, w2v, b_gate, b_up = ops.expert_views(t["w1"], t["w2"], t["w3"], t["b1"], family)
    E, n, top_k = gate.shape[0], lora.n_adapters(), t["ids"].shape[1]
    groups = ops.group_ids(t["ids"].cpu(), None if lora.adapter_ids is None else lora.adapter_ids.cpu(), E, n, 0, E)
    align = [a.to(t["x"].device) for a in torch.ops.flash_moe.moe_align(groups, E * n, ops.BLOCK_M, 1, 0, E * n,
                                                                          ops.CONSTANTS["CLUSTER_BLOCKS"])]
    args = (t["x"], gate, up if family.gated else None, w2v, *align, t["tw"], top_k, ops.BLOCK_M, deterministic, True,
            E, lora.scaling, *lora.adapters(), activation, family.alpha, family.limit, b_gate, b_up, t["b2"])
    return args, groups


def compact_references(args, groups, n):
    """float64 [g | u] and [u_gate | u_up] (u = s_a x A^T, unrounded) of the routed slots in the alignment's order:
    what moe_lora_forward's gate_up and lora_rows hold."""
    x, gate, up, _, sorted_ids, *_ = args
    top_k = args[8]
    scaling, (a_gate, b_gate, a_up, b_up) = args[13].cpu(), args[14:18]
    b_gate_bias, b_up_bias = args[23:25]
    slots = sorted_ids.cpu()[sorted_ids.cpu() >= 0].long()
    group = groups.reshape(-1)[slots].long()
    d = lambda v: None if v is None else v.cpu().double()
    x64, rows, u_rows = d(x)[slots // top_k], [], []
    for i in range(len(slots)):
        e, a = int(group[i]) // n, int(group[i]) % n
        z, s = x64[i:i + 1], float(scaling[a])
        pre, us = [], []
        for w, bias, la, lb in ((gate, b_gate_bias, a_gate, b_gate), (up, b_up_bias, a_up, b_up)):
            if w is None:
                continue
            y = z @ d(w[e]).t() + (0 if bias is None else d(bias[e]))
            if la is not None:
                u = s * (z @ d(la[a, e]).t())
                y = y + u @ d(lb[a, e]).t()
                us.append(u)
            pre.append(y)
        rows.append(torch.cat(pre, 1))
        u_rows.append(torch.cat(us, 1) if us else z.new_zeros(1, 0))
    return torch.cat(rows), torch.cat(u_rows)


OP_CASES = [(2, 16, ("swiglu", "separate", False, "b1")), (4, 64, ("gpt_oss", "interleaved", True, "b1 b2")),
            (1, 8, ("relu2", "stacked", True, "b2")), (2, 64, ("swiglu", "stacked", True, ""))]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "slots"])
@pytest.mark.parametrize("case", OP_CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_fused_ops_against_the_cpu_definition(case, deterministic):
    """moe_lora_forward and moe_lora_gate_up on CUDA (fused) and on the CPU (the definition) on the same inputs and
    alignment: out, g | u and the rank-r rows each within 1.5x the CPU op's error against float64; the recomputation
    gives the forward's g | u and rank-r rows bitwise (the same kernels)."""
    n, rank, family = case
    t, layout = make_problem(320, 256, 192, 4, 3, family, seed=17, device="cuda")
    lora = make_lora(n, 4, 256, 192, rank, family[0] != "relu2", device="cuda",
                     adapter_ids=torch.randint(0, n, (320,), generator=torch.Generator().manual_seed(5)).cuda())
    args, groups = op_arguments(t, layout, family[0], lora, deterministic)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    ours, theirs = torch.ops.flash_moe.moe_lora_forward(*args), torch.ops.flash_moe.moe_lora_forward(*cpu_args)
    f64 = {k: None if v is None else v.double().cpu() for k, v in t.items()}
    f64["ids"], f64["tw"] = t["ids"].cpu(), t["tw"].double().cpu()
    lora64 = ops.MoeLora(lora.scaling.cpu().double(), *[None if a is None else a.double().cpu() for a in
                                                        lora.adapters()], adapter_ids=lora.adapter_ids.cpu())
    ref_out = reference.moe_per_expert(f64["x"], f64["w1"], f64["w2"], f64["w3"], f64["ids"], f64["tw"],
                                       activation=family[0], b1=f64["b1"], b2=f64["b2"], layout=layout, lora=lora64)
    ref_gate_up, ref_rows = compact_references(args, groups, n)
    label = f"gpu op {case_id(case)} deterministic={deterministic}"
    assert_error_ratio(f"{label} out", ours[0].cpu(), theirs[0], ref_out, MAX_RATIO)
    assert_error_ratio(f"{label} gate_up", ours[1].cpu(), theirs[1], ref_gate_up, MAX_RATIO)
    assert_error_ratio(f"{label} lora_rows", ours[2].cpu(), theirs[2], ref_rows, MAX_RATIO)
    gate_up_args = (*args[:3], *args[4:7], args[8], args[9], args[13], *args[14:18], args[12], *args[23:25])
    recomputed = torch.ops.flash_moe.moe_lora_gate_up(*gate_up_args)
    assert torch.equal(recomputed[0], ours[1]) and torch.equal(recomputed[1], ours[2])


def grad_x_references(args, groups, n, grad_gate, grad_up):
    """float64 dx (per token, summed over its routed slots) and [w_gate | w_up] (w = s_a d B, unrounded) of the
    routed slots in the alignment's order: what moe_lora_grad_x returns."""
    x, gate, up, _, sorted_ids, *_ = args
    top_k = args[8]
    scaling, (a_gate, b_gate, a_up, b_up) = args[13].cpu(), args[14:18]
    slots = sorted_ids.cpu()[sorted_ids.cpu() >= 0].long()
    group = groups.reshape(-1)[slots].long()
    d = lambda v: None if v is None else v.cpu().double()
    dx = torch.zeros(x.shape, dtype=torch.float64)
    rows = []
    for i in range(len(slots)):
        e, a = int(group[i]) // n, int(group[i]) % n
        s, ws = float(scaling[a]), []
        for w, grad, la, lb in ((gate, grad_gate, a_gate, b_gate), (up, grad_up, a_up, b_up)):
            if grad is None:
                continue
            g = d(grad[i:i + 1])
            dx[slots[i] // top_k] += (g @ d(w[e]))[0]
            if la is not None:
                v = s * (g @ d(lb[a, e]))
                dx[slots[i] // top_k] += (v @ d(la[a, e]))[0]
                ws.append(v)
        rows.append(torch.cat(ws, 1) if ws else torch.zeros(1, 0, dtype=torch.float64))
    return dx, torch.cat(rows)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "slots"])
@pytest.mark.parametrize("case", OP_CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_fused_grad_x_against_the_cpu_definition(case, deterministic):
    """moe_lora_grad_x on CUDA (fused: the shrink over dg | du, then the dX GEMM with its K extension) and on the CPU
    on the same inputs: dx and [w_gate | w_up] each within 1.5x the CPU op's error against float64; dg and du as moe()'s
    backward passes them (the halves of one tensor, interleaved for gpt-oss's pairs)."""
    n, rank, family = case
    t, layout = make_problem(320, 256, 192, 4, 3, family, seed=19, device="cuda")
    lora = make_lora(n, 4, 256, 192, rank, family[0] != "relu2", device="cuda",
                     adapter_ids=torch.randint(0, n, (320,), generator=torch.Generator().manual_seed(6)).cuda())
    args, groups = op_arguments(t, layout, family[0], lora, deterministic)
    gated = args[2] is not None
    slots = 320 * 3
    dgu = torch.randn(slots, (2 if gated else 1) * 192, generator=torch.Generator().manual_seed(8)).bfloat16().cuda()
    if not gated:
        grad_gate, grad_up = dgu, None
    elif layout.gate_up == "interleaved":
        grad_gate, grad_up = dgu[:, 0::2], dgu[:, 1::2]
    else:
        grad_gate, grad_up = dgu[:, :192], dgu[:, 192:]
    call = (grad_gate, grad_up, args[1], args[2], *args[4:7], args[8], args[9], deterministic, args[13],
            *args[14:18], args[12])
    ours = torch.ops.flash_moe.moe_lora_grad_x(*call)
    theirs = torch.ops.flash_moe.moe_lora_grad_x(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in call])
    ref_dx, ref_rows = grad_x_references(args, groups, n, grad_gate, grad_up)
    label = f"gpu moe_lora_grad_x {case_id(case)} deterministic={deterministic}"
    assert_error_ratio(f"{label} dx", ours[0].cpu(), theirs[0], ref_dx, MAX_RATIO)
    assert_error_ratio(f"{label} lora_rows", ours[1].cpu(), theirs[1], ref_rows, MAX_RATIO)


def grad_gate_up_references(args, groups, n, family, grad_out, gate_up):
    """float64 dg | du, p h, dL/dp and [v | p s h A_down^T] (v = s grad_out B_down; unrounded) of the routed slots in
    the alignment's order, from the saved g | u: what moe_lora_grad_gate_up returns."""
    _, _, up, w2v, sorted_ids, *_ = args
    tw, top_k, scaling, a_down, b_down = args[7].cpu().double(), args[8], args[13].cpu(), args[18], args[19]
    slots = sorted_ids.cpu()[sorted_ids.cpu() >= 0].long()
    group = groups.reshape(-1)[slots].long()
    d = lambda v: v.cpu().double()
    hidden = w2v.shape[2]
    grads, weighted, rows = [], [], []
    grad_p = torch.zeros(tw.shape, dtype=torch.float64)
    for i in range(len(slots)):
        e, a = int(group[i]) // n, int(group[i]) % n
        s, p = float(scaling[a]), tw.reshape(-1)[slots[i]]
        go = d(grad_out[slots[i] // top_k]).unsqueeze(0)
        grad_h = go @ d(w2v[e])
        v = s * (go @ d(b_down[a, e])) if a_down is not None else None
        if v is not None:
            grad_h = grad_h + v @ d(a_down[a, e])
        g = d(gate_up[i:i + 1, :hidden]).requires_grad_()
        u = d(gate_up[i:i + 1, hidden:]).requires_grad_() if up is not None else None
        h = reference.activate(g, u, family)
        dg_du = torch.autograd.grad(h, [g] + ([u] if u is not None else []), grad_h * p)
        grads.append(torch.cat(dg_du, 1))
        weighted.append(p * h.detach())
        grad_p.view(-1)[slots[i]] = (grad_h * h.detach()).sum()
        if v is not None:
            rows.append(torch.cat([v, p * s * (h.detach() @ d(a_down[a, e]).t())], 1))
    rows = torch.cat(rows) if rows else torch.zeros(len(slots), 0, dtype=torch.float64)
    return torch.cat(grads), torch.cat(weighted), grad_p, rows


@pytest.mark.parametrize("case", OP_CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_gpu_lora_fused_grad_gate_up_against_the_cpu_definition(case):
    """moe_lora_grad_gate_up on CUDA (fused: the shrink over grad_out, the dH GEMM with its K extension and its
    activation-backward epilogue, the weighted shrink over h) and on the CPU on the same inputs: dg | du, p h, dL/dp
    and [v | p s h A_down^T] each within 1.5x the CPU op's error against float64."""
    n, rank, family = case
    t, layout = make_problem(320, 256, 192, 4, 3, family, seed=23, device="cuda")
    lora = make_lora(n, 4, 256, 192, rank, family[0] != "relu2", device="cuda",
                     adapter_ids=torch.randint(0, n, (320,), generator=torch.Generator().manual_seed(9)).cuda())
    args, groups = op_arguments(t, layout, family[0], lora, False)
    routed = int((args[4] >= 0).sum())
    gen = torch.Generator().manual_seed(10)
    gate_up = torch.zeros(320 * 3, (2 if args[2] is not None else 1) * 192)
    gate_up[:routed] = 2 * torch.randn(routed, gate_up.shape[1], generator=gen)
    gate_up = gate_up.bfloat16().cuda()
    grad_out = torch.randn(320, 256, generator=gen).bfloat16().cuda()
    call = (grad_out, args[3], gate_up, *args[4:7], args[7], args[8], args[9], args[13], args[18], args[19], args[12],
            family[0], args[21], args[22])
    ours = torch.ops.flash_moe.moe_lora_grad_gate_up(*call)
    theirs = torch.ops.flash_moe.moe_lora_grad_gate_up(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in call])
    fam = ops.make_family(family[0], args[21], args[22], layout, t["w3"])
    refs = grad_gate_up_references(args, groups, n, fam, grad_out, gate_up)
    label = f"gpu moe_lora_grad_gate_up {case_id(case)}"
    for name, a, b, r in zip(("dg | du", "p h", "dL/dp", "lora_rows"), ours, theirs, refs):
        rows = r.shape[0] if name != "dL/dp" else a.shape[0]
        assert_error_ratio(f"{label} {name}", a.cpu()[:rows], b[:rows], r, MAX_RATIO)
