"""flash_moe as a transformers experts implementation (prime_kernels_flash_moe.integrations): tiny randomly initialised
Qwen3-MoE, Mixtral (SwiGLU), gpt-oss (its clamped sigmoid-GLU, interleaved transposed weights, biases) and Nemotron-H
(relu2, up_proj only) models built in code, bf16, one MoE block and the whole model, forward and backward, flash_moe
registered strict (a fallback would raise) and counted on every MoE layer. The output and every gradient are judged
against a float64 copy of the same model on the same inputs (transformers' eager experts loop), as a ratio to the
error of the bf16 baseline (at most 1.5x): transformers' grouped_mm path, or the model's own eager experts. The float64 copy takes
the routing decisions of the bf16 run it judges (its routers' top-k forced to that run's ids), so a near-tie that
rounding flips is not counted as error. Also: the layouts flash_moe refuses, with a sentence, falling back to
grouped_mm (reason logged once) or raising with strict=True; expert id == num_experts skipped in moe().
CPU tests run everywhere transformers is installed; ``@pytest.mark.gpu`` ones need CUDA and an sm_90a build."""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import re

import pytest
import torch

from prime_kernels_core.testing import RATIO_RESOLUTION, ROUNDING_FLOOR_SLACK, kernel_module, relative_error

ops = kernel_module("flash_moe", "prime_kernels_flash_moe.ops")

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs "
                                                           "it): the integration tests need it")
tf_moe = pytest.importorskip("transformers.integrations.moe", reason="this transformers has no experts registry")
if not hasattr(tf_moe, "ALL_EXPERTS_FUNCTIONS"):
    pytest.skip(f"transformers {transformers.__version__} has no ALL_EXPERTS_FUNCTIONS (needs 5.x)",
                allow_module_level=True)

from prime_kernels_flash_moe import integrations  # noqa: E402  (after the skips: it needs transformers to register)

KERNEL = "flash_moe"
MAX_RATIO = 1.5
# a gradient of fewer elements (gpt-oss's attention sinks: one per head) is judged with the other small ones: a ratio
# of errors measured on a handful of numbers is one rounding's luck (2 heads: 0.58x in one layer, 2.67x in the next)
MIN_JUDGED_ELEMENTS = 64
NAME = integrations.register_transformers()
STRICT = integrations.register_transformers("flash_moe_strict", strict=True)
cpu = pytest.mark.kernel(KERNEL, device="cpu")
gpu = [pytest.mark.gpu, pytest.mark.kernel(KERNEL)]


def qwen3_config(**kw):
    return transformers.Qwen3MoeConfig(**{
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 128, **kw})


def mixtral_config(**kw):
    return transformers.MixtralConfig(**{
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 128, **kw})


def gpt_oss_config(**kw):
    """gpt-oss: interleaved, transposed gate_up_proj with biases, the clamped sigmoid-GLU (its config's alpha, limit)."""
    return transformers.GptOssConfig(**{
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 16, **kw})  # its default context (YaRN factor 32 of 4096)


def nemotron_h_config(**kw):
    """Nemotron-H's MoE layers (relu2 experts, up_proj only) between attention, no Mamba layers (their CPU path is
    not what is tested here)."""
    return transformers.NemotronHConfig(**{
        "vocab_size": 256, "hidden_size": 128, "layers_block_type": ["moe", "full_attention", "moe"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
        "max_position_embeddings": 128, "use_mamba_kernels": False, **kw})


MODELS = {"qwen3_moe": (qwen3_config, transformers.Qwen3MoeForCausalLM),
          "mixtral": (mixtral_config, transformers.MixtralForCausalLM),
          "gpt_oss": (gpt_oss_config, transformers.GptOssForCausalLM),
          "nemotron_h": (nemotron_h_config, transformers.NemotronHForCausalLM)}
# the bf16 path each model's flash_moe run is judged against: transformers' default (grouped_mm) where flash_moe served
# these models before; the model's own eager experts for the families added since (issue 55 names that baseline)
BASELINES = {"qwen3_moe": "grouped_mm", "mixtral": "grouped_mm", "gpt_oss": "eager", "nemotron_h": "eager"}


def make_model(kind, seed=0, device="cpu", **config):
    """A bf16 model on ``device`` whose experts and routers are scaled so the MoE output is O(1) and routing is
    decisive (the default init, std 0.02, makes both negligible next to the residual stream)."""
    make_config, cls = MODELS[kind]
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: the Qwen3-30B-A3B-shaped block has 400M parameters
        model = cls(make_config(**config))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "down_proj") and isinstance(module.down_proj, torch.nn.Parameter):
                in_axis = 1 if getattr(module, "is_transposed", False) else 2  # the weights' fan-in
                for name in ("gate_up_proj", "up_proj", "down_proj"):
                    if hasattr(module, name):
                        getattr(module, name).normal_(0, getattr(module, name).shape[in_axis] ** -0.5)
                for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
                    if isinstance(getattr(module, name, None), torch.nn.Parameter):
                        getattr(module, name).normal_(0, 0.5)
            elif is_router(module):
                module.weight.normal_(0, module.weight.shape[-1] ** -0.5)
    return model.to(torch.bfloat16).eval()


def is_router(module):
    """transformers' MoE routers: *TopKRouter (Qwen3-MoE, Mixtral, gpt-oss), NemotronHTopkRouter."""
    return type(module).__name__.lower().endswith("topkrouter")


def with_experts(model, implementation, dtype=None):
    other = copy.deepcopy(model)
    if dtype is not None:
        other = other.to(dtype)
    other.set_experts_implementation(implementation)
    return other


def routers(model):
    return [(n, m) for n, m in model.named_modules() if is_router(m)]


@contextlib.contextmanager
def recorded_routing(model):
    """{router name: the top-k ids it chose} for one forward."""
    records = {}
    handles = [m.register_forward_hook(lambda mod, args, out, n=n: records.__setitem__(n, out[2].detach().clone()))
               for n, m in routers(model)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def forced_routing(model, records):
    """Each router's torch.topk over experts returns the recorded ids (and its own probabilities at them) for one
    forward; its other torch.topk calls (Nemotron-H's expert-group choice, k = topk_group) run as they are."""
    real_topk = torch.topk

    def before(name):
        def hook(mod, args):
            ids = records[name]

            def topk(probs, k, dim=-1, **kwargs):
                if k != ids.shape[-1] or probs.shape[-1] != mod.weight.shape[0]:
                    return real_topk(probs, k, dim, **kwargs)
                assert dim in (-1, probs.dim() - 1)
                forced = ids.to(probs.device)
                return probs.gather(-1, forced), forced

            torch.topk = topk
        return hook

    def after(mod, args, out):
        torch.topk = real_topk

    handles = []
    for n, m in routers(model):
        handles += [m.register_forward_pre_hook(before(n)), m.register_forward_hook(after)]
    try:
        yield
    finally:
        torch.topk = real_topk
        for h in handles:
            h.remove()


def run(fn, model, inputs, grad_out):
    """(output, {name: gradient} of the parameters and of float inputs, routing) of fn(model, inputs)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with recorded_routing(model) as routing:
        out = fn(model, *inputs)
    out.backward(grad_out.to(out.dtype))
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"input {i}": t.grad for i, t in enumerate(inputs) if t.is_floating_point()})
    return out.detach(), grads, routing


def reference(fn, model, inputs, grad_out, routing):
    ref = with_experts(model, "eager", torch.float64)
    with forced_routing(ref, routing):
        out, grads, seen = run(fn, ref, [t.double() if t.is_floating_point() else t for t in inputs], grad_out)
    for name, ids in routing.items():
        assert torch.equal(seen[name].cpu(), ids.cpu()), f"routing was not forced for {name}"
    return out, grads


def assert_within_ratio(label, ours, ours_ref, theirs, theirs_ref, baseline="grouped_mm"):
    """ours' error against its float64 reference at most MAX_RATIO x theirs' against theirs (or at the rounding
    floor), as prime_kernels_core.testing.assert_error_ratio but with each run's own reference (routing)."""
    e_ours, e_theirs = relative_error(ours, ours_ref), relative_error(theirs, theirs_ref)
    floor = relative_error(ours_ref.to(ours.dtype), ours_ref)
    ratio = e_ours / e_theirs if e_theirs > 0 else (0.0 if e_ours == 0 else float("inf"))
    print(f"{label}: error {e_ours:.3e}, {baseline} {e_theirs:.3e}, ratio {ratio:.3f} (limit {MAX_RATIO}); "
          f"rounding floor {floor:.3e}")
    assert ratio <= MAX_RATIO * (1 + RATIO_RESOLUTION) or e_ours <= floor * (1 + ROUNDING_FLOOR_SLACK), (
        f"{label}: error {e_ours:.3e} is {ratio:.4f}x {baseline}'s {e_theirs:.3e} (limit {MAX_RATIO})")


@contextlib.contextmanager
def counted_moe_calls():
    """[number of ops.moe calls] while inside (the integration reaches moe through this module attribute)."""
    real_moe, calls = ops.moe, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real_moe(*args, **kwargs)

    ops.moe = counting
    try:
        yield calls
    finally:
        ops.moe = real_moe


def check_against(label, model, fn, inputs, grad_out, baseline="grouped_mm"):
    """flash_moe (registered strict: a fallback would raise) computing every MoE layer, its output and every gradient
    within the ratio rule of ``baseline``'s (a transformers experts implementation), each against float64 eager."""
    with counted_moe_calls() as calls:
        ours, g_ours, r_ours = run(fn, with_experts(model, STRICT), inputs, grad_out)
    assert calls[0] == len(r_ours) >= 1, f"{label}: flash_moe ran {calls[0]} of {len(r_ours)} MoE layers"
    theirs, g_theirs, r_theirs = run(fn, with_experts(model, baseline), inputs, grad_out)
    ours_ref, g_ours_ref = reference(fn, model, inputs, grad_out, r_ours)
    theirs_ref, g_theirs_ref = reference(fn, model, inputs, grad_out, r_theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape  # Nemotron-H's logits are fp32
    assert_within_ratio(f"{label} output", ours, ours_ref, theirs, theirs_ref, baseline)
    assert g_ours.keys() == g_theirs.keys()
    checked, small = 0, []
    for name, g in g_ours.items():
        if g_ours_ref[name] is None:
            assert g is None and g_theirs[name] is None, f"{label}: {name} has a gradient only on one path"
            continue
        assert g is not None and g.dtype == g_theirs[name].dtype and g.shape == g_theirs[name].shape, name
        if g_ours_ref[name].norm() == 0:
            assert g.abs().max() == 0, f"{label} grad {name} should be zero"
            continue
        if g.numel() < MIN_JUDGED_ELEMENTS:
            small.append(name)
            continue
        assert_within_ratio(f"{label} grad {name}", g, g_ours_ref[name], g_theirs[name], g_theirs_ref[name], baseline)
        checked += 1
    if small:  # judged together, each scaled by its reference's norm so that none dominates
        def joined(grads, refs):
            return torch.cat([grads[n].double().flatten() / refs[n].norm() for n in small])

        assert_within_ratio(f"{label} grads {', '.join(small)}", joined(g_ours, g_ours_ref),
                            joined(g_ours_ref, g_ours_ref), joined(g_theirs, g_theirs_ref),
                            joined(g_theirs_ref, g_theirs_ref), baseline)
    assert sum(".experts." in n and g_ours_ref[n] is not None for n in g_ours) >= 2, f"{label}: no expert gradients"
    assert checked >= 3, f"{label}: only {checked} gradients compared"


def moe_block(model):
    """The first layer's MoE block (Nemotron-H keeps it as the layer's mixer)."""
    layer = model.model.layers[0]
    return layer.mixer if hasattr(layer, "mixer") else layer.mlp


def block_forward(model, hidden_states):
    out = moe_block(model)(hidden_states)
    return out[0] if isinstance(out, tuple) else out  # gpt-oss's block returns (output, router scores)


def model_forward(model, input_ids):
    return model(input_ids).logits


def check_block(kind, device, tokens=(2, 40), seed=0, **config):
    model = make_model(kind, seed, device, **config)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*tokens, model.config.hidden_size, generator=g).to(torch.bfloat16).to(device)
    go = torch.randn(x.shape, generator=g).to(torch.bfloat16).to(device)
    check_against(f"{kind} block", model, block_forward, [x], go, BASELINES[kind])


def check_model(kind, device, seed=0):
    model = make_model(kind, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g).to(device)
    go = torch.randn(2, 24, model.config.vocab_size, generator=g).to(torch.bfloat16).to(device)
    check_against(f"{kind} model", model, model_forward, [ids], go, BASELINES[kind])


@cpu
@pytest.mark.parametrize("kind", list(MODELS))
def test_cpu_block(kind):
    check_block(kind, "cpu")


@cpu
@pytest.mark.parametrize("kind", list(MODELS))
def test_cpu_model(kind):
    check_model(kind, "cpu")


@cpu
@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_block_matches_eager(kind):
    """torch.compile(fullgraph=True) traces a transformers MoE block through the integration (no graph break)."""
    model = with_experts(make_model(kind, seed=2), STRICT)
    block = moe_block(model)
    x = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16).requires_grad_()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        with counted_moe_calls() as calls:
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
        assert calls[0] == 1
        results.append([out.detach(), *torch.autograd.grad(out.float().square().sum(), [x, *block.parameters()])])
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_register_is_idempotent_and_returns_the_name():
    assert integrations.register_transformers() == NAME == "flash_moe"
    assert integrations.register_transformers() == NAME
    assert NAME in tf_moe.ALL_EXPERTS_FUNCTIONS and STRICT in tf_moe.ALL_EXPERTS_FUNCTIONS


def test_register_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(integrations, "_moe_module", None)
    monkeypatch.delattr(tf_moe, "ALL_EXPERTS_FUNCTIONS")
    with pytest.raises(RuntimeError, match=r"needs transformers 5.x.*lacks ALL_EXPERTS_FUNCTIONS"):
        integrations.register_transformers()
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(RuntimeError, match=r"needs transformers 5.x installed \(pip install transformers\)"):
        integrations.register_transformers()


def qwen3_experts(**config):
    return make_model("qwen3_moe", **config).model.layers[0].mlp.experts


class CustomGateExperts(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts):
    def _apply_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=7.0)) * up


def _flip(attribute, value):
    def change(experts):
        setattr(experts, attribute, value)
    return change


@pytest.mark.parametrize("change, words", [
    (_flip("has_gate", False), "has no gate (has_gate=False: up_proj only) and activation SiLUActivation"),
    (_flip("has_bias", True), "has no gate_up_proj_bias, down_proj_bias tensor"),
    (_flip("is_transposed", True), "weights are not gate_up_proj (E, H, 2I) and down_proj (E, I, H)"),
    (_flip("is_concatenated", False), "declares is_concatenated=False (gate and up interleaved) but its _apply_gate "
                                      "reads them stacked"),
    (_flip("has_post_expert_norm", True), "normalizes each expert's output"),
    (lambda e: setattr(e, "act_fn", torch.nn.GELU()), "activation is GELU, not SiLU"),
    (lambda e: delattr(e, "has_gate"), "layout is unknown"),
    (lambda e: setattr(e, "num_experts", 7), "num_experts is 7 but gate_up_proj holds 8"),
])
def test_layout_reasons(change, words):
    experts = qwen3_experts()
    assert integrations.unsupported_layout_reason(experts) is None
    change(experts)
    reason = integrations.unsupported_layout_reason(experts)
    assert reason is not None and words in reason and reason.startswith("Qwen3MoeExperts")


def test_older_release_without_a_layout_flag(monkeypatch):
    """transformers 5.17 (the H200 image's) has no has_post_expert_norm: its modules lack the attribute, and no model
    of that release can have the layout, so flash_moe runs them; a module that sets it anyway is refused."""
    moe = integrations._transformers_moe()
    real = moe.use_experts_implementation

    def older(experts_class=None, *, experts_interface=None, is_concatenated=True, is_transposed=False,
              has_bias=False, has_gate=True):
        return real(experts_class, is_concatenated=is_concatenated, is_transposed=is_transposed, has_bias=has_bias,
                    has_gate=has_gate)

    monkeypatch.setattr(moe, "use_experts_implementation", older)
    experts = qwen3_experts()
    monkeypatch.delattr(type(experts), "has_post_expert_norm", raising=False)
    monkeypatch.delattr(experts, "has_post_expert_norm", raising=False)
    assert not hasattr(experts, "has_post_expert_norm")
    assert integrations.unsupported_layout_reason(experts) is None
    experts.has_post_expert_norm = True
    assert "a layout this transformers release does not define" in integrations.unsupported_layout_reason(experts)
    monkeypatch.delattr(experts, "has_post_expert_norm")
    monkeypatch.delattr(experts, "has_gate", raising=False)
    monkeypatch.delattr(type(experts), "has_gate", raising=False)
    assert "has no has_gate" in integrations.unsupported_layout_reason(experts)


def test_custom_gate_is_refused():
    experts = qwen3_experts()
    custom = CustomGateExperts(experts.config)
    assert "has its own gating (_apply_gate)" in integrations.unsupported_layout_reason(custom)


def real_refused_experts():
    """(experts module, the words of its reason): transformers experts flash_moe does not compute (DeepSeek-V4's
    clamped SiLU gate; Nemotron-H configured with a non-gated activation other than relu2)."""
    deepseek_v4 = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts(transformers.DeepseekV4Config(
        hidden_size=128, intermediate_size=64, num_local_experts=4))
    nemotron = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts(transformers.NemotronHConfig(
        hidden_size=128, moe_intermediate_size=64, n_routed_experts=4, mlp_hidden_act="gelu"))
    return [(deepseek_v4, "has its own gating (_apply_gate)"), (nemotron, "has no gate (has_gate=False: up_proj only) "
                                                                           "and activation GELUActivation")]


def _routing(T, E, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    return ids, torch.rand(T, top_k, generator=g).softmax(-1)


def test_refused_experts_fall_back_to_grouped_mm_and_log_once(caplog):
    for experts, words in real_refused_experts():
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.1)
        experts = experts.to(torch.bfloat16)
        ids, weights = _routing(30, 4, 2, seed=3)
        x = torch.randn(30, 128).to(torch.bfloat16)
        expected = tf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, ids, weights)
        with caplog.at_level(logging.WARNING, logger=integrations.__name__):
            caplog.clear()
            for _ in range(2):
                got = tf_moe.ALL_EXPERTS_FUNCTIONS[NAME](experts, x, ids, weights)
                assert torch.equal(got, expected)
        messages = [r.getMessage() for r in caplog.records if words in r.getMessage()]
        assert len(messages) == 1 and "grouped_mm" in messages[0], caplog.text
        with pytest.raises(RuntimeError, match=f"flash_moe experts \\(strict\\): .*{re.escape(words)}"):
            tf_moe.ALL_EXPERTS_FUNCTIONS[STRICT](experts, x, ids, weights)


@pytest.mark.parametrize("change, words", [
    (lambda e, x: (e.float(), x), "needs bfloat16 expert weights, got gate_up_proj torch.float32"),
    (lambda e, x: (e, x.view(2, 15, -1)), "needs hidden_states (tokens, 128)"),
])
def test_call_reasons_fall_back_or_raise(change, words):
    experts = qwen3_experts()
    ids, weights = _routing(30, 8, 2, seed=4)
    experts, x = change(experts, torch.randn(30, 128).to(torch.bfloat16))
    reason = integrations.unsupported_call_reason(experts, x, ids, weights)
    assert reason is not None and words in reason
    with pytest.raises(RuntimeError, match="strict"):
        tf_moe.ALL_EXPERTS_FUNCTIONS[STRICT](experts, x, ids, weights)
    if x.dim() == 2:  # grouped_mm itself takes 2-D hidden states only
        torch.testing.assert_close(tf_moe.ALL_EXPERTS_FUNCTIONS[NAME](experts, x, ids, weights),
                                   tf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, ids, weights), rtol=0, atol=0)


def test_shape_contract_falls_back():
    """hidden 96 is not a multiple of DIM_ALIGN: the reason is ops.unsupported_shape_reason's."""
    model = make_model("mixtral", hidden_size=96, head_dim=48)
    experts = model.model.layers[0].mlp.experts
    ids, weights = _routing(10, 4, 2, seed=5)
    x = torch.randn(10, 96).to(torch.bfloat16)
    assert integrations.unsupported_call_reason(experts, x, ids, weights) == ops.unsupported_shape_reason(96, 128)
    with pytest.raises(RuntimeError, match="multiple of"):
        tf_moe.ALL_EXPERTS_FUNCTIONS[STRICT](experts, x, ids, weights)


def call_experts(module, implementation, x, ids, weights, grad_out):
    """(output, gradients of x, top_k_weights and every parameter of ``module``) of one experts call through
    transformers' ``implementation``, in the module's dtype."""
    dtype = next(module.parameters()).dtype
    leaves = [x.to(dtype).requires_grad_(), weights.to(dtype).requires_grad_()]
    fn = tf_moe.ALL_EXPERTS_FUNCTIONS.get_interface(implementation, type(module).forward.__wrapped__)
    out = fn(module, leaves[0], ids, leaves[1])
    return out, torch.autograd.grad(out, [*leaves, *module.parameters()], grad_out.to(dtype))


def _experts_of(model_type, config_class, experts_class, **config):
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    configuration = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    return getattr(modeling, experts_class)(getattr(configuration, config_class)(hidden_size=128, **config))


# transformers experts classes of each family flash_moe computes (layout flags and gates read in 5.24): the
# activation moe() gets, and a tiny module of the class
SERVED = {
    "GptOssExperts": ("gpt_oss", lambda: _experts_of("gpt_oss", "GptOssConfig", "GptOssExperts",
                                                     intermediate_size=64, num_local_experts=4)),
    "OpenAIPrivacyFilterExperts": ("gpt_oss", lambda: _experts_of(
        "openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterExperts", intermediate_size=64,
        num_local_experts=4)),
    "MiniMaxM3VLExperts": ("gpt_oss", lambda: _experts_of("minimax_m3_vl", "MiniMaxM3VLTextConfig",
                                                          "MiniMaxM3VLExperts", intermediate_size=64,
                                                          num_local_experts=4)),
    "AriaExperts": ("swiglu", lambda: _experts_of("aria", "AriaTextConfig", "AriaExperts", intermediate_size=64,
                                                  moe_num_experts=4)),
    "NemotronHExperts": ("relu2", lambda: _experts_of("nemotron_h", "NemotronHConfig", "NemotronHExperts",
                                                      moe_intermediate_size=64, n_routed_experts=4)),
}


def check_served(experts_class, device):
    """One transformers experts class of a family flash_moe computes, called through the strict registration:
    flash_moe runs it (no fallback), output and the gradients of x, top_k_weights, every weight and bias within the
    ratio of grouped_mm's against float64 eager."""
    activation, make = SERVED[experts_class]
    experts = make()
    unflagged = [f for f in ("has_gate", "has_bias", "is_transposed", "is_concatenated") if not hasattr(experts, f)]
    if unflagged:  # an older transformers (the GPU machine's) declares no layout for this class: it falls back there
        pytest.skip(f"{experts_class} has no {', '.join(unflagged)} in transformers {transformers.__version__}")
    family, reason = integrations.experts_family(experts)
    assert reason is None and family.activation == activation
    in_axis = 1 if experts.is_transposed else 2
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.normal_(0, 0.5 if name.endswith("_bias") else p.shape[in_axis] ** -0.5)
    experts = experts.to(device, torch.bfloat16)
    ids, weights = (t.to(device) for t in _routing(60, 4, 2, seed=12))
    x = torch.randn(60, 128, generator=torch.Generator().manual_seed(13)).to(device, torch.bfloat16)
    go = torch.randn(60, 128, generator=torch.Generator().manual_seed(14)).to(device, torch.bfloat16)
    with counted_moe_calls() as calls:
        ours = call_experts(experts, STRICT, x, ids, weights, go)
    assert calls[0] == 1
    theirs = call_experts(experts, "grouped_mm", x, ids, weights, go)
    ref = call_experts(copy.deepcopy(experts).double(), "eager", x, ids, weights, go)
    assert_within_ratio(f"{experts_class} output", ours[0], ref[0], theirs[0], ref[0])
    names = ["x", "top_k_weights", *(n for n, _ in experts.named_parameters())]
    assert len(names) == len(ours[1]) >= 4
    for name, a, b, r in zip(names, ours[1], theirs[1], ref[1]):
        assert_within_ratio(f"{experts_class} grad {name}", a, r, b, r)


@cpu
@pytest.mark.parametrize("experts_class", list(SERVED))
def test_cpu_served_experts_classes(experts_class):
    check_served(experts_class, "cpu")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("experts_class", list(SERVED))
def test_cuda_served_experts_classes(experts_class):
    check_served(experts_class, "cuda")


@cpu
def test_expert_parallel_sentinels_through_transformers():
    """Under transformers' expert parallelism (AllReduceEP) the experts see local ids with other ranks' routes marked
    num_experts (weight 0): flash_moe skips them, output and gradients within the ratio of grouped_mm's EP path."""
    experts = qwen3_experts()
    experts._is_expert_parallel = True
    E = experts.num_experts
    ids, weights = _routing(60, E, 2, seed=8)
    off_rank = torch.rand(ids.shape, generator=torch.Generator().manual_seed(9)) < 0.4
    ids, weights = torch.where(off_rank, E, ids), weights.masked_fill(off_rank, 0.0).to(torch.bfloat16)
    x = torch.randn(60, 128, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    go = torch.randn(60, 128, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    ref_experts = copy.deepcopy(experts).double()
    with counted_moe_calls() as calls:
        ours = call_experts(experts, NAME, x, ids, weights, go)
    assert calls[0] == 1
    theirs = call_experts(experts, "grouped_mm", x, ids, weights, go)
    ref = call_experts(ref_experts, "eager", x, ids, weights, go)
    assert_within_ratio("EP output", ours[0], ref[0], theirs[0], ref[0])
    for name, a, b, r in zip(("x", "top_k_weights", "gate_up_proj", "down_proj"), ours[1], theirs[1], ref[1]):
        assert_within_ratio(f"EP grad {name}", a, r, b, r)


def check_sentinel_ids(device):
    """transformers' unrouted marking (id == num_experts) is skipped in moe(): as -1, forward and every gradient."""
    g = torch.Generator().manual_seed(6)
    T, E, k, dim, hidden = 70, 4, 3, 128, 64
    x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    w1, w3 = ((torch.randn(E, hidden, dim, generator=g) / dim**0.5).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(E, dim, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[::4, 1] = E
    ids[5] = E  # a token with no expert at all: its row is zero
    tw = torch.rand(T, k, generator=g).softmax(-1)
    results = []
    for unrouted in (E, -1):
        marked = torch.where(ids == E, unrouted, ids)
        leaves = [t.to(device).requires_grad_() for t in (x, w1, w2, w3, tw)]
        out = ops.moe(*leaves[:4], marked.to(device), leaves[4])
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert (results[0][0][5] == 0).all() and (results[0][-1][5] == 0).all()


@cpu
def test_cpu_expert_id_num_experts_is_skipped():
    check_sentinel_ids("cpu")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_expert_id_num_experts_is_skipped():
    check_sentinel_ids("cuda")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("kind", list(MODELS))
def test_cuda_block(kind):
    check_block(kind, "cuda")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("kind", list(MODELS))
def test_cuda_model(kind):
    check_model(kind, "cuda")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
def test_cuda_qwen3_30b_a3b_shaped_block():
    """One Qwen3-30B-A3B-shaped block (H 2048, I 768, 128 experts, top 8), 1024 tokens."""
    check_block("qwen3_moe", "cuda", tokens=(2, 512), hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
                num_hidden_layers=1)


@pytest.mark.parametrize("name", ["grouped_mm", "batched_mm"])
def test_a_name_transformers_uses_is_refused(name):
    """register_transformers("grouped_mm") made every fallback call flash_moe again (RecursionError; issue 61,
    item 9): the name is refused and transformers' own function stays."""
    own = tf_moe.ALL_EXPERTS_FUNCTIONS[name]
    with pytest.raises(ValueError, match=f"register_transformers: name '{name}' is taken by transformers"):
        integrations.register_transformers(name)
    assert tf_moe.ALL_EXPERTS_FUNCTIONS[name] is own
    assert integrations.register_transformers(NAME) == NAME  # its own names stay re-registrable, strict or not
    assert integrations.register_transformers(NAME, strict=True) == NAME
    assert integrations.register_transformers(NAME) == NAME
