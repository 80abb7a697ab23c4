"""Tests for the Triton example plugin: numerics against float64 (the Triton functions through Triton's interpreter, in
a child process with TRITON_INTERPRET=1, and the PyTorch CPU path), the conformance kit, the shipped code in the wheel,
the shape contract, argument errors, and the GPU run.

Run after installing the wheel: ``python -m pytest examples/triton_plugin/tests -q -s`` (``-s`` shows the error
ratios). Every test skips, with the reason, when the kernel cannot run where it asks to.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prime_kernels
from prime_kernels_core import manifest
from prime_kernels_core.testing import assert_conforms, assert_error_ratio

KERNEL = "moe_router"
pytestmark = pytest.mark.kernel(KERNEL, device="cpu")
CONFIGS = {
    "deepseek-v3": dict(n_experts=256, n_groups=8, topk_groups=4, top_k=8, score="sigmoid", renormalize=True, scale=2.5),
    "qwen3-moe": dict(n_experts=128, n_groups=1, topk_groups=1, top_k=8, score="softmax", renormalize=True, scale=1.0),
    "odd": dict(n_experts=37, n_groups=1, topk_groups=1, top_k=5, score="softmax", renormalize=False, scale=1.0),
    "one-per-group": dict(n_experts=16, n_groups=16, topk_groups=3, top_k=2, score="sigmoid", renormalize=True,
                          scale=1.0),
}
# An fp32 output's error is arithmetic (the order of a softmax's sum, exp's last bit), not output rounding, so its ratio
# to PyTorch's gets room, as the C++ example's fp32 outputs do; 16-bit outputs round alike on both paths: 2%.
FP32_MAX_RATIO, HALF_MAX_RATIO = 2.0, 1.02
# The Triton functions on the CPU: the interpreter runs a program per token in Python, so the shapes stay small.
INTERPRETER_SHAPES = {"deepseek-v3": 6, "qwen3-moe": 5, "odd": 7, "one-per-group": 4}


@pytest.fixture(scope="module")
def ops():
    return prime_kernels.load(KERNEL, "cpu")


def _inputs(tokens, config, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, config["n_experts"], generator=gen, dtype=torch.float64)
    bias = 0.1 * torch.randn(config["n_experts"], generator=gen)
    return logits.to(device=device, dtype=dtype), bias.to(device)


def _options(config):
    return {k: v for k, v in config.items() if k != "n_experts"}


def _reference(ops, logits, bias, config, dtype):
    return ops.route_reference(logits, bias, config["n_groups"], config["topk_groups"], config["top_k"],
                               config["score"] == "sigmoid", config["renormalize"], config["scale"], dtype=dtype)


def check_route(ops, tokens, config, dtype, device, label, judge_grad=True):
    """The kernel's experts miss the float64 reference's no more often than the PyTorch path's (plus one near tie in
    a thousand tokens: a last-bit difference in a score can flip it); its weights, on the tokens where both paths chose
    the reference's experts, and its gradient, at the reference's experts, are judged by the error ratio; autograd
    reaches the backward op at the experts the forward chose."""
    logits, bias = _inputs(tokens, config, dtype, device)
    weights, experts = ops.moe_route(logits, bias, **_options(config))
    base_weights, base_experts = _reference(ops, logits, bias, config, torch.float32)
    ref_weights, ref_experts = _reference(ops, logits, bias, config, torch.float64)
    matches = lambda chosen: (chosen.sort(-1).values == ref_experts.sort(-1).values).all(-1)
    assert int((~matches(experts)).sum()) <= int((~matches(base_experts)).sum()) + tokens // 1000, (
        f"{label}: experts differ from float64's")
    same = matches(experts) & matches(base_experts)
    order = lambda chosen, w: w.gather(1, chosen.argsort(-1))  # weights in the order of expert index
    assert_error_ratio(f"{label} weights", order(experts, weights)[same], order(base_experts, base_weights)[same],
                       order(ref_experts, ref_weights)[same], FP32_MAX_RATIO)
    if not judge_grad:
        return
    grad = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1)).to(device)
    flags = (config["score"] == "sigmoid", config["renormalize"], config["scale"])
    ours = ops.route_backward(logits, ref_experts, grad, *flags)
    base = ops.route_backward_reference(logits, ref_experts, grad, *flags, dtype=torch.float32)
    ref = ops.route_backward_reference(logits.double(), ref_experts, grad.double(), *flags, dtype=torch.float64)
    assert_error_ratio(f"{label} grad logits", ours, base, ref, FP32_MAX_RATIO if dtype == torch.float32 else HALF_MAX_RATIO)
    x = logits.detach().requires_grad_()
    weights, experts = ops.moe_route(x, bias, **_options(config))
    weights.backward(grad)
    torch.testing.assert_close(x.grad, ops.route_backward(logits, experts, grad, *flags), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pytorch_cpu_path_matches_float64(ops, name, dtype):
    check_route(ops, 64, CONFIGS[name], dtype, "cpu", f"cpu {name} {dtype}")


def test_triton_functions_through_the_interpreter_match_float64():
    """The Triton functions themselves on the CPU: a child process with TRITON_INTERPRET=1 (Triton reads it once, at
    import) runs the numerics checks there."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("interpreted_moe_router.py"))], env=env,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, f"the interpreted run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "interpreted_moe_router: ok" in done.stdout


def test_conforms():
    """The kit on the PyTorch CPU path here, and (cpu lists "interpreter") in a child with TRITON_INTERPRET=1."""
    assert_conforms(KERNEL)


def test_wheel_ships_code_for_every_listed_arch():
    """The installed package holds a cubin for every listed arch and specialization, as its build record says."""
    folder = manifest.package_dir("pk_example_router")
    table = manifest.load(folder)["kernels"][KERNEL]
    record = json.loads((folder / manifest.BUILD_RECORD_NAME).read_text())["kernels"][KERNEL]
    assert record["archs"] == table["archs"] and not record["not_built"], record["not_built"]
    per_arch = sum(len(s.get("dtypes") or [None]) for s in table["specializations"])
    for arch in table["archs"]:
        shipped = [s for s in record["shipped"] if s["arch"] == arch]
        assert len(shipped) == per_arch, f"{arch}: {len(shipped)} shipped functions, the manifest names {per_arch}"
        for entry in shipped:
            cubin = (folder / entry["file"]).read_bytes()
            assert cubin[:4] == b"\x7fELF", f"{entry['file']} is not a cubin (ELF)"


@pytest.mark.parametrize("function", ["route", "route_backward"])
def test_shipped_cubin_is_what_the_jit_compiles_for_the_ops_call(tmp_path, monkeypatch, function):
    """The shipped code against Triton's JIT on a real call, without a GPU: the op's own launch arguments (CPU tensors
    at their addresses, its ints and constexprs, the manifest's options) given to Triton's JIT for the 9.0a target
    (jit_target) compile with the hash the build recorded and to the shipped cubin's machine code, instruction for
    instruction. Bytes are not compared: the debug line table names kernels.py's path, the build's source tree in the
    shipped cubin and the installed package in the JIT's."""
    triton = pytest.importorskip("triton")
    from prime_kernels_core import jit_runtime, jit_target

    from pk_example_router import ops as router_ops

    folder = manifest.package_dir("pk_example_router")
    built_with = json.loads((folder / manifest.BUILD_RECORD_NAME).read_text())["kernels"][KERNEL]["library_version"]
    if triton.__version__ != built_with:
        pytest.skip(f"the shipped code was compiled by Triton {built_with} and this process has Triton "
                    f"{triton.__version__}, whose JIT compiles other code (shipped code runs under either)")

    launched = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(router_ops, "_pytorch_on_cpu", lambda tensor: False)
    monkeypatch.setattr(jit_runtime, "launch", lambda *call: launched.append(call))
    logits, bias = _inputs(16, CONFIGS["deepseek-v3"], torch.bfloat16)
    if function == "route":
        router_ops.route(logits, bias, 8, 4, 8, True, True, 2.5)
    else:
        experts = torch.stack([torch.randperm(256)[:8] for _ in range(16)])
        router_ops.route_backward(logits, experts, torch.randn(16, 8), True, True, 2.5)
    kernel, fn, grid, args, constexprs = launched[0]
    entry, why = jit_runtime._shipped_entry("pk_example_router", KERNEL, fn.fn.__name__, fn.arg_names, args,
                                            constexprs, torch.device("cuda", 0))
    assert entry is not None, why
    assert entry["arch"] == "9.0a"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # a fresh compile, not the build's from a cache
    compiled = jit_target.compiled_by_the_jit(fn, "9.0a", args, {**constexprs, **jit_runtime._options(
        "pk_example_router", KERNEL, fn.fn.__name__)})
    assert compiled.hash == entry["triton_hash"], "the JIT compiled other inputs than the build (source, " \
        "specialization, options, target or ptxas)"
    shipped = (folder / entry["file"]).read_bytes()
    assert jit_target.machine_code(compiled.asm["cubin"]) == jit_target.machine_code(shipped)


def test_shape_contract(ops):
    assert ops.unsupported_shape_reason(256) is None and ops.unsupported_shape_reason(1) is None
    with pytest.raises(prime_kernels.UnsupportedShapeError, match="at most 1024 experts"):
        prime_kernels.check_shape(ops, 1025)


@pytest.mark.parametrize("change, message", [
    (lambda x, b: (x[0], b), r"logits must be 2-D \[tokens, experts\], got 1-D"),
    (lambda x, b: (x.double(), b), "logits must be float32, bfloat16 or float16, got torch.float64"),
    (lambda x, b: (x, b[:-1]), r"bias must have shape \[16\]"),
    (lambda x, b: (x, b.half()), "bias must be float32, got torch.float16"),
])
def test_bad_arguments_name_the_argument(ops, change, message):
    logits, bias = _inputs(3, CONFIGS["one-per-group"], torch.float32)
    with pytest.raises(RuntimeError, match=message):
        ops.moe_route(*change(logits, bias), top_k=2)


@pytest.mark.parametrize("options, message", [
    (dict(top_k=2, n_groups=3), "n_groups must be positive and divide the 16 experts, got 3"),
    (dict(top_k=2, n_groups=4, topk_groups=5), r"topk_groups must be in \[1, n_groups=4\], got 5"),
    (dict(top_k=9, n_groups=4, topk_groups=2), r"top_k must be in \[1, 8\]"),
])
def test_bad_routing_options_name_the_option(ops, options, message):
    with pytest.raises(RuntimeError, match=message):
        ops.moe_route(*_inputs(3, CONFIGS["one-per-group"], torch.float32), **options)


def test_non_tensors_and_bad_scores_are_named(ops):
    logits, bias = _inputs(3, CONFIGS["one-per-group"], torch.float32)
    with pytest.raises(TypeError, match="moe_route: logits must be a torch.Tensor, got list"):
        ops.moe_route([[1.0]], bias, top_k=2)
    with pytest.raises(TypeError, match="moe_route: top_k must be an int, got float"):
        ops.moe_route(logits, bias, top_k=2.0)
    with pytest.raises(ValueError, match="score must be 'sigmoid' or 'softmax', got 'relu'"):
        ops.moe_route(logits, bias, top_k=2, score="relu")


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_matches_float64(ops, name, dtype):
    for tokens in (1, 333, 16384):
        check_route(ops, tokens, CONFIGS[name], dtype, "cuda", f"cuda {name} {dtype} {tokens} tokens")
    torch.cuda.synchronize()


@pytest.mark.parametrize("capability, arch", [((9, 0), "9.0a"), ((8, 6), "8.0"), ((8, 9), "8.9"), ((12, 0), "12.0a")])
def test_a_shipped_call_finds_its_cubin(monkeypatch, capability, arch):
    """The runtime's selection against the installed record: a DeepSeek-V3 bf16 call on a device of each capability
    gets the cubin of the best arch for it; an fp16 call, which was not shipped, gets the sentence saying so."""
    from prime_kernels_core import jit_runtime

    from pk_example_router import kernels

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    logits, bias = _inputs(4, CONFIGS["deepseek-v3"], torch.bfloat16)
    out = torch.empty(4, 8), torch.empty(4, 8, dtype=torch.int64)
    constexprs = dict(N_EXPERTS=256, N_GROUPS=8, TOPK_GROUPS=4, TOP_K=8, SIGMOID=True, RENORMALIZE=True)
    miss = lambda x: jit_runtime._shipped_miss("pk_example_router", KERNEL, "route_forward",
                                               kernels.route_forward.arg_names, (x, bias, *out, 256, 2.5),
                                               constexprs, torch.device("cuda", 0))
    entry, why = miss(logits)
    assert entry is not None, why
    assert entry["arch"] == arch and entry["arg_types"] == "OOOOifOO"
    assert (manifest.package_dir("pk_example_router") / entry["file"]).is_file()
    assert miss(logits.half())[1].startswith("no shipped route_forward for this call's specialization (logits *fp16")


def test_discovery_and_library_gating_never_import_triton():
    """A fresh process: discovery, the spec and the library check leave Triton unimported."""
    code = ("import sys; from prime_kernels_core import jit_gating, registry; registry.entries(); "
            "spec = registry.spec('moe_router'); assert jit_gating.library_reason(spec) is None; "
            "print(sorted(m for m in ('triton', 'pk_example_router.ops', 'pk_example_router.kernels') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
