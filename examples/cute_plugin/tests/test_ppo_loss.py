"""Tests for the CuTe DSL example plugin: numerics against float64 (the PyTorch CPU path here, the CuTe kernel on the
GPU), the conformance kit, the shipped objects in the wheel (loaded by the installed DSL, without a GPU), which object
serves a device, argument errors, and discovery without the DSL.

Run after installing the wheel: ``python -m pytest examples/cute_plugin/tests -q -s`` (``-s`` shows the error
ratios). Tests needing nvidia-cutlass-dsl skip, with the reason, where it is not installed.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import prime_kernels
from prime_kernels_core import manifest
from prime_kernels_core.testing import assert_conforms, assert_error_ratio

KERNEL = "ppo_loss"
PACKAGE = "pk_example_rl"
pytestmark = pytest.mark.kernel(KERNEL, device="cpu")
needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                               reason="nvidia-cutlass-dsl is not installed (scripts/setup.sh installs it)")
CONFIGS = {
    "ppo": dict(eps_low=0.2, eps_high=0.2, dual_clip=None),
    "dapo-asymmetric": dict(eps_low=0.2, eps_high=0.28, dual_clip=None),
    "dual-clip": dict(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
}
# The loss and its gradient are a few fp32 operations per token (exp, products, a clamp): both paths round alike, so
# the kernel's error may exceed PyTorch's by exp's last bit only.
MAX_RATIO = 1.05
# Tokens whose ratio lies this close (relative) to a clip bound or whose two objectives this close to each other take
# either branch by a last-bit difference (a different branch is a different gradient): judged on the rest.
NEAR_BRANCH = 1e-5


@pytest.fixture(scope="module")
def ops():
    return prime_kernels.load(KERNEL, "cpu")


def inputs(shape, dtype, device="cpu", seed=0):
    """Sampled tokens' log-probabilities under the sampling policy (old) and a policy some steps on (logp: ratios
    e^N(0, 0.5), about 70 % outside a 0.2 clip range and 1.5 % above a dual clip of 3), and standard-normal
    advantages; made in float64."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 4
    logp = old + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    return logp.to(device, dtype), old.to(device, dtype), advantages.to(device, torch.float32)


def pytorch_path(logp, old_logp, advantages, eps_low, eps_high, dual_clip, grad, dtype):
    """What a trainer writes (the path the kernel replaces), in ``dtype``: the loss and autograd's d loss / d logp."""
    x = logp.detach().to(dtype).requires_grad_()
    ratio = torch.exp(x - old_logp.to(dtype))
    advantage = advantages.to(dtype)
    objective = torch.min(ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage)
    if dual_clip is not None:
        objective = torch.where(advantage < 0, torch.max(objective, dual_clip * advantage), objective)
    loss = -objective
    loss.backward(grad.to(dtype))
    return loss.detach(), x.grad


def away_from_branches(logp, old_logp, advantages, eps_low, eps_high, dual_clip):
    """The tokens whose branch (clipped or not, dual-clipped or not) no last-bit difference can flip."""
    ratio = torch.exp(logp.double() - old_logp.double())
    advantage = advantages.double()
    keep = ((ratio - (1 - eps_low)).abs() > NEAR_BRANCH) & ((ratio - (1 + eps_high)).abs() > NEAR_BRANCH)
    if dual_clip is not None:
        objective = torch.min(ratio * advantage, ratio.clamp(1 - eps_low, 1 + eps_high) * advantage)
        keep &= (objective - dual_clip * advantage).abs() > NEAR_BRANCH * advantage.abs()
    return keep


def check_loss(ops, shape, dtype, config, device, label):
    """The op's loss and its gradient in logp (through autograd, so the backward too), judged against float64 by the
    error ratio to the PyTorch path's, on the tokens away from a branch."""
    logp, old, advantages = inputs(shape, dtype, device)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    x = logp.clone().requires_grad_()
    loss = ops.ppo_clip_loss(x, old, advantages, **config)
    loss.backward(grad)
    base_loss, base_grad = pytorch_path(logp, old, advantages, **config, grad=grad, dtype=torch.float32)
    ref_loss, ref_grad = pytorch_path(logp, old, advantages, **config, grad=grad, dtype=torch.float64)
    keep = away_from_branches(logp, old, advantages, **config)
    assert keep.float().mean() > 0.99, f"{label}: only {keep.float().mean():.3f} of the tokens judged"
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
    assert_error_ratio(f"{label} loss", loss[keep], base_loss[keep], ref_loss[keep], MAX_RATIO)
    # The gradient in logp's dtype is what both return: bf16 rounding of the same fp32 value.
    assert_error_ratio(f"{label} grad logp", x.grad[keep], base_grad.to(dtype)[keep], ref_grad[keep], MAX_RATIO)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpu_path_matches_float64(ops, name, dtype):
    check_loss(ops, (8, 1000), dtype, CONFIGS[name], "cpu", f"cpu {name} {dtype}")


def test_the_clipped_branch_has_no_gradient(ops):
    """A positive advantage with the ratio above 1 + eps_high, and a negative one below 1 - eps_low: clipped, so the
    token's loss is constant in logp; the dual clip's floor likewise (ratio 5 with A < 0)."""
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 5.0])).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss = ops.ppo_clip_loss(logp, old, advantages, dual_clip=3.0)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -1.1, 3.0]))
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -1.1, 0.0]))


def test_conforms():
    """The kit on the PyTorch CPU path: schema, fake, opcheck, autograd, torch.compile(fullgraph=True)."""
    assert_conforms(KERNEL)


def _record():
    folder = manifest.package_dir(PACKAGE)
    return folder, manifest.load(folder)["kernels"][KERNEL], manifest.read_build_record(folder)["kernels"][KERNEL]


@needs_dsl
def test_wheel_ships_an_object_for_every_listed_arch_and_specialization():
    """The installed package holds one object per listed arch and specialization, as its build record says, each an
    ELF object compiled for that arch."""
    from prime_kernels_core import jit_manifest

    folder, table, record = _record()
    assert record["archs"] == table["archs"] and not record["not_built"], record["not_built"]
    specializations = [s for spec in table["specializations"] for s in jit_manifest.expanded(spec)]
    for arch in table["archs"]:
        shipped = [{k: e[k] for k in specializations[0]} for e in record["shipped"] if e["arch"] == arch]
        assert sorted(map(json.dumps, shipped)) == sorted(map(json.dumps, specializations)), arch
    for entry in record["shipped"]:
        data = (folder / entry["file"]).read_bytes()
        assert data[:4] == b"\x7fELF", f"{entry['file']} is not an ELF object"
        major, minor = manifest.capability_of(entry["arch"])
        assert embedded_sm(data) == major * 10 + minor, f"{entry['file']}'s cubin is not for {entry['arch']}"


def embedded_sm(data: bytes) -> int:
    """The SM of the cubin inside a CuTe DSL object (the first ELF after the object's own header): its ELF flags hold
    it in the low byte (CUDA ELF ABI 7, up to sm_90a) or the second byte (ABI 8, sm_100 and newer)."""
    import struct

    cubin = data[data.find(b"\x7fELF", 1):]
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return flags & 0xFF if cubin[8] < 8 else (flags >> 8) & 0xFF


@needs_dsl
def test_every_shipped_object_loads_in_a_fresh_process_without_compilers():
    """The installed DSL links every shipped object in a process with nothing on PATH and finds its function (calling
    it needs a GPU: test_ppo_loss_gpu.py)."""
    folder, _, record = _record()
    code = ("import json, sys, cutlass.cute as cute\n"
            "for path, prefix in json.loads(sys.argv[1]):\n"
            "    print(type(getattr(cute.runtime.load_module(path), prefix)).__name__)\n")
    objects = [[str(folder / e["file"]), e["prefix"]] for e in record["shipped"]]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(objects)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PATH="/nonexistent"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split().count("CudaDialectJitCompiledFunction") == len(objects), done.stdout


@needs_dsl
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the GPU tests run the object")
def test_a_shipped_objects_arguments_as_the_runtime_assembles_them_reach_cuda(monkeypatch):
    """Without a GPU, the furthest a call goes: the runtime's plan for a shipped bf16 object (from_dlpack views, the
    scalars, the stream inserted where the signature says) is accepted by the DSL's argument checks and fails in CUDA
    (no driver); one argument short, the DSL names the missing one."""
    from prime_kernels_core import cute_runtime

    folder, _, record = _record()
    entry = next(e for e in record["shipped"] if e["arch"] == "9.0a" and e["signature"]["logp"] == "BFloat16[tokens]")
    specialization = {k: entry[k] for k in ("function", "signature", "constexprs", "align")}
    plan = cute_runtime.Plan(getattr(cute_runtime._module(str(folder / entry["file"])), entry["prefix"]),
                             specialization, shipped=True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
    logp, old, advantages = inputs((1000,), torch.bfloat16)
    args = (logp, old, advantages, torch.empty(1000), torch.empty(1000), 0.8, 1.2, 3.0)
    with pytest.raises(Exception) as raised:
        plan.run(args, torch.device("cpu"))
    assert type(raised.value).__name__ == "DSLCudaRuntimeError", raised.value
    with pytest.raises(Exception, match="Missing required arguments"):
        plan.run(args[:-1], torch.device("cpu"))


@needs_dsl
def test_plans_for_a_shipped_and_an_unshipped_call(monkeypatch):
    """The runtime's plans on a pretend sm_90 device (no GPU here: its capability and context stubbed): a bf16 call
    gets the shipped 9.0a object, loaded; a float16 call (not shipped) is compiled by cute.compile with the manifest's
    layout and the reason is recorded once, for status; the next float16 call reuses that plan."""
    from contextlib import nullcontext

    from prime_kernels_core import cute_runtime, jit_runtime

    from pk_example_rl import kernels

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda index: nullcontext())
    monkeypatch.setattr(cute_runtime, "_plans", {})
    monkeypatch.setattr(jit_runtime, "_fallbacks", {})
    device = torch.device("cuda", 0)
    constexprs = dict(THREADS=256, DUAL_CLIP=False)

    def plan(dtype, offset=0):
        logp, old, advantages = (t[offset:] for t in inputs((1000 + offset,), dtype))
        args = (logp, old, advantages, torch.empty(1000), torch.empty(1000), 0.8, 1.2, 0.0)
        return cute_runtime.plan(KERNEL, kernels.ppo_loss_forward, args, constexprs, device)

    shipped = plan(torch.bfloat16)
    assert shipped.shipped and shipped.specialization["signature"]["logp"] == "BFloat16[tokens]"
    assert jit_runtime.fallbacks() == {}
    with pytest.warns(RuntimeWarning, match="compiling it now"):
        compiled = plan(torch.float16)
    assert not compiled.shipped and type(compiled.compiled).__name__ == "CudaDialectJitCompiledFunction"
    assert compiled.specialization == {**shipped.specialization, "signature": {
        **shipped.specialization["signature"], "logp": "Float16[tokens]", "old_logp": "Float16[tokens]"}}
    assert jit_runtime.fallbacks() == {KERNEL: [
        "no shipped ppo_loss_forward for this call's specialization (logp Float16[tokens], old_logp Float16[tokens], "
        "advantages Float32[tokens], loss Float32[tokens], slope Float32[tokens], low Float32, high Float32, "
        "dual_clip Float32, DUAL_CLIP=False, THREADS=256, aligned to 16 bytes)"]}
    assert plan(torch.float16) is compiled
    with pytest.warns(RuntimeWarning, match="a tensor of this call is not 16-byte aligned"):
        misaligned = plan(torch.bfloat16, offset=1)
    assert not misaligned.shipped and "align" not in misaligned.specialization


@pytest.mark.parametrize("capability, arch", [((9, 0), "9.0a"), ((8, 6), "8.0"), ((8, 9), "8.0"), ((10, 0), "10.0a"),
                                              ((12, 0), "12.0a")])
def test_a_shipped_call_finds_its_object(monkeypatch, capability, arch):
    """The runtime's choice against the installed record, for the op's own call: a bf16 dual-clip call on a device of
    each capability gets the object of the best arch for it (loading stubbed: no GPU here); an fp32 call with another
    block size gets the sentence saying it compiles."""
    from prime_kernels_core import cute_runtime

    loaded = []
    monkeypatch.setattr(cute_runtime, "_module", lambda path: loaded.append(path) or type("M", (), {
        "ppo_loss_forward": path}))
    described = (("BFloat16", 1), ("BFloat16", 1), ("Float32", 1), ("Float32", 1), ("Float32", 1), "float", "float",
                 "float")
    specialization = cute_runtime.specialization_for(PACKAGE, KERNEL, "ppo_loss_forward", described,
                                                     {"THREADS": 256, "DUAL_CLIP": True}, aligned=True)
    function, why = cute_runtime.shipped_function(PACKAGE, KERNEL, specialization, capability)
    assert why == "" and function == loaded[0]
    entry = next(e for e in _record()[2]["shipped"] if loaded[0].endswith(e["file"]))
    assert entry["arch"] == arch and entry["signature"]["logp"] == "BFloat16[tokens]"
    other = cute_runtime.specialization_for(PACKAGE, KERNEL, "ppo_loss_forward", described,
                                            {"THREADS": 128, "DUAL_CLIP": True}, aligned=True)
    assert cute_runtime.shipped_function(PACKAGE, KERNEL, other, capability)[1].startswith(
        "no shipped ppo_loss_forward for this call's specialization (logp BFloat16[tokens], old_logp BFloat16[tokens]")


def test_shape_contract(ops):
    assert ops.unsupported_shape_reason(0) is None and ops.unsupported_shape_reason(10**9) is None
    assert ops.unsupported_shape_reason(-1) == "ppo_loss needs a non-negative number of tokens, got -1"


@pytest.mark.parametrize("change, message", [
    (lambda l, o, a: (l.half(), o.half(), a), "logp must be float32 or bfloat16, got torch.float16"),
    (lambda l, o, a: (l, o.bfloat16(), a), "old_logp must have logp's dtype torch.float32, got torch.bfloat16"),
    (lambda l, o, a: (l, o, a.double()), "advantages must be float32, got torch.float64"),
    (lambda l, o, a: (l, o[:, :3], a), r"old_logp must have logp's shape \[2, 5\], got \[2, 3\]"),
    (lambda l, o, a: (l, o, a[0]), r"advantages must have logp's shape \[2, 5\], got \[5\]"),
])
def test_bad_tensors_name_the_argument(ops, change, message):
    with pytest.raises(RuntimeError, match=message):
        ops.ppo_clip_loss(*change(*inputs((2, 5), torch.float32)))


@pytest.mark.parametrize("options, message", [
    (dict(eps_low=1.0), r"eps_low must be in \[0, 1\), got 1.0"),
    (dict(eps_high=-0.1), "eps_high must be finite and non-negative, got -0.1"),
    (dict(dual_clip=0.5), "dual_clip must be None or a finite value above 1, got 0.5"),
])
def test_bad_options_name_the_option(ops, options, message):
    with pytest.raises(RuntimeError, match=message):
        ops.ppo_clip_loss(*inputs((2, 5), torch.float32), **options)


def test_non_tensors_are_named(ops):
    logp, old, advantages = inputs((2, 5), torch.float32)
    with pytest.raises(TypeError, match="ppo_clip_loss: old_logp must be a torch.Tensor, got list"):
        ops.ppo_clip_loss(logp, [0.0], advantages)
    with pytest.raises(TypeError, match="ppo_clip_loss: dual_clip must be a float or None, got str"):
        ops.ppo_clip_loss(logp, old, advantages, dual_clip="3")


def test_discovery_and_library_gating_never_import_the_dsl():
    """A fresh process: discovery, the spec, the library check and the status note leave the DSL unimported."""
    code = ("import sys; from prime_kernels_core import jit_gating, registry; registry.entries(); "
            "spec = registry.spec('ppo_loss'); jit_gating.library_reason(spec); "
            "jit_gating.note(spec, registry.Target('cuda', 0, (9, 0))); "
            "print(sorted(m for m in ('cutlass', 'pk_example_rl.ops', 'pk_example_rl.kernels') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.gpu
@pytest.mark.kernel(KERNEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_matches_float64(ops, name, dtype):
    """The CuTe kernel (shipped object for this GPU) against float64, as the CPU path above; odd token counts cover
    the last block's bound check."""
    for shape in ((1,), (3, 333), (64, 4099)):
        check_loss(ops, shape, dtype, CONFIGS[name], "cuda", f"cuda {name} {dtype} {shape}")
    torch.cuda.synchronize()
