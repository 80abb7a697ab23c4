"""Static checks of the installed flash_moe's sm_90a SASS (CPU: cuobjdump reads the compiled kernels, no GPU needed):
each bf16 GEMM kernel instantiation moe_gemm_kernel<MODE, ACT, WEIGHTS> reads its B tiles in the majorness its mode and
weight form call for, keeps its accumulators in registers, and exists for every form the host can pick; the LoRA
instantiations (the shrink modes, the modes with the LORA_EXTENSION flag) run at the base ones' register count without
stack. The mode and form numbers are read from the kernel source, the one place they are defined."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from prime_kernels_core import release

CUDA_SOURCES = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
KERNEL = re.compile(r"moe_gemm_kernelILi(\d+)ELi(\d+)ELi(\d+)E")
SHRINKS = ("LORA_SHRINK_X", "LORA_SHRINK_H", "LORA_SHRINK_D", "LORA_SHRINK_G", "LORA_SHRINK_P")


def _enum(source: str, head: str) -> dict[str, int]:
    """The enumerators of the `enum HEAD : int { A = 0, ... }` in csrc/cuda/SOURCE."""
    body = re.search(re.escape(head) + r" : int \{([^}]*)\}", (CUDA_SOURCES / source).read_text()).group(1)
    return {k: int(v) for k, v in re.findall(r"(\w+) = (\d+)", body)}


def _modes():
    return _enum("fused_moe_sm90.cu", "enum Mode")


def _lora_flag():
    return _enum("fused_moe_sm90.cu", "enum ModeFlag")["LORA_EXTENSION"]


def _forms():
    return _enum("fused_moe_sm90.cu", "enum WeightForm")


def _activations():
    return _enum("sm90_common.cuh", "enum")


def _cuobjdump(*args: str) -> str:
    """cuobjdump's output for the installed extension's sm_90a code (skips where there is none to read)."""
    tool = release._cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump found (triton's, the CUDA toolkit's or the PATH's)")
    spec = importlib.util.find_spec("prime_kernels_flash_moe._C")
    if spec is None or spec.origin is None:
        pytest.skip("prime_kernels_flash_moe._C is not installed")
    return subprocess.run([tool, *args, "-arch", "sm_90a", spec.origin], capture_output=True, text=True).stdout


def _per_kernel(listing: str, separator: str) -> dict[tuple[int, int, int], str]:
    found = {}
    for function in re.split(separator, listing)[1:]:
        match = KERNEL.search(function.split("\n", 1)[0])
        if match:
            found[tuple(int(g) for g in match.groups())] = function
    if not found:
        pytest.skip("the installed flash_moe holds no sm_90a code (a CPU-only build)")
    return found


@pytest.fixture(scope="module")
def kernels() -> dict[tuple[int, int, int], str]:
    """(MODE, ACT, WEIGHTS) -> the SASS of that instantiation, from the installed extension's sm_90a cubin."""
    return _per_kernel(_cuobjdump("-sass"), r"\n\s*Function : ")


@pytest.fixture(scope="module")
def resources() -> dict[tuple[int, int, int], dict[str, int]]:
    """(MODE, ACT, WEIGHTS) -> cuobjdump -res-usage's REG, STACK, LOCAL of that instantiation."""
    usage = _per_kernel(_cuobjdump("-res-usage"), r"\n\s*Function ")
    return {k: {name: int(v) for name, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
            for k, text in usage.items()}


def test_b_tiles_flip_majorness_with_transposed_weights(kernels):
    """The base K tiles' B follows the weights' form; the LoRA extension's B is the adapters' own layout whatever the
    weights' form: K-major in the forward GEMMs (B (out, r)), N-major in dH and dX (A (r, in)); LORA_SHRINK_D and
    LORA_SHRINK_G read B_gate, B_up (hidden, r) and B_down (dim, r) N-major."""
    modes, forms, flag = _modes(), _forms(), _lora_flag()
    backward = {modes["DH_SWIGLU"], modes["DX_ATOMIC"], modes["DX_SLOTS"]}
    n_major_extension = backward
    n_major_shrinks = {modes["LORA_SHRINK_D"], modes["LORA_SHRINK_G"]}
    for (mode, act, weights), sass in kernels.items():
        wgmmas = re.findall(r"HGMMA\.64x256x16\.F32\.BF16[^;]*", sass)
        assert wgmmas, f"moe_gemm_kernel<{mode}, {act}, {weights}> has no m64n256k16 bf16 wgmma"
        base = mode & ~flag
        n_major = base in n_major_shrinks or (base in backward) != (weights != forms["kOutIn"])
        expected = {n_major, base in n_major_extension} if mode & flag else {n_major}
        transposed_b = {".tnspB" in w for w in wgmmas}
        assert transposed_b == expected, (
            f"moe_gemm_kernel<{mode}, {act}, {weights}>: expected wgmmas with B "
            f"{sorted('N-major (.tnspB)' if n else 'K-major' for n in expected)}, found {sorted(transposed_b)}")


def test_accumulators_stay_in_registers(kernels):
    """No local memory, except the dH kernel with gpt_oss's clamped derivative (one spilled word: a store and a load)."""
    modes, acts = _modes(), _activations()
    for (mode, act, weights), sass in kernels.items():
        local = len(re.findall(r"\b(?:STL|LDL)\b", sass))
        allowed = 2 if (mode, act) == (modes["DH_SWIGLU"], acts["kActGptOss"]) else 0
        assert local <= allowed, f"moe_gemm_kernel<{mode}, {act}, {weights}>: {local} local-memory accesses"


def test_every_weight_form_the_host_picks_is_compiled(kernels):
    modes, forms, acts = _modes(), _forms(), _activations()
    all_acts = tuple(acts.values())
    gated_acts = tuple(v for k, v in acts.items() if k != "kActRelu2")
    persistent_gate_up = [modes[m] for m in ("GATE_UP_PERSISTENT", "GATE_UP_SAVE_PERSISTENT",
                                             "GATE_UP_AND_SAVE_PERSISTENT")]
    expected = {(m, a, forms["kInOut"]) for m in persistent_gate_up for a in all_acts}
    expected |= {(m, a, forms["kInOutPairs"]) for m in persistent_gate_up for a in gated_acts}
    expected |= {(modes["DH_SWIGLU"], a, w) for a in all_acts for w in (forms["kOutIn"], forms["kInOut"])}
    expected |= {(modes[m], acts["kActSwiGLU"], w) for m in ("DOWN_ATOMIC", "DOWN_SLOTS", "DX_ATOMIC", "DX_SLOTS")
                 for w in (forms["kOutIn"], forms["kInOut"])}
    missing = expected - kernels.keys()
    assert not missing, f"instantiations missing from the sm_90a code: {sorted(missing)}"


def test_every_lora_kernel_the_host_picks_is_compiled(kernels):
    """The moe_lora_* ops: the shrinks, every gate/up mode's persistent twin with the extension for every activation
    and form, dH with it for every activation, and both down and both dX modes with it, each for both weight forms."""
    modes, forms, acts, flag = _modes(), _forms(), _activations(), _lora_flag()
    gated_acts = tuple(v for k, v in acts.items() if k != "kActRelu2")
    twins = [modes[m] | flag for m in ("GATE_UP_PERSISTENT", "GATE_UP_SAVE_PERSISTENT", "GATE_UP_AND_SAVE_PERSISTENT")]
    expected = {(m, a, w) for m in twins for a in acts.values() for w in (forms["kOutIn"], forms["kInOut"])}
    expected |= {(m, a, forms["kInOutPairs"]) for m in twins for a in gated_acts}
    expected |= {(modes[m] | flag, acts["kActSwiGLU"], w) for m in ("DOWN_ATOMIC", "DOWN_SLOTS", "DX_ATOMIC", "DX_SLOTS")
                 for w in (forms["kOutIn"], forms["kInOut"])}
    expected |= {(modes["DH_SWIGLU"] | flag, a, w) for a in acts.values() for w in (forms["kOutIn"], forms["kInOut"])}
    expected |= {(modes[m], acts["kActSwiGLU"], forms["kOutIn"]) for m in SHRINKS}
    missing = expected - kernels.keys()
    assert not missing, f"LoRA instantiations missing from the sm_90a code: {sorted(missing)}"


def test_lora_kernels_keep_the_base_registers(resources):
    """The LoRA instantiations use the registers the base GEMMs do (all of them: one CTA of 384 threads per SM) and
    no stack or local memory."""
    modes, flag = _modes(), _lora_flag()
    shrinks = {modes[m] for m in SHRINKS}
    lora = {k for k in resources if k[0] & flag or k[0] in shrinks}
    assert lora, "no LoRA instantiation in the sm_90a code"
    base_regs = {r["REG"] for k, r in resources.items() if k not in lora}
    assert len(base_regs) == 1, f"the base GEMMs use different register counts: {sorted(base_regs)}"
    for key in sorted(lora):
        r = resources[key]
        assert r["REG"] in base_regs and r["STACK"] == 0 and r["LOCAL"] == 0, f"moe_gemm_kernel<{key}>: {r}"
