"""Static checks of the installed flash_moe's sm_90a SASS (CPU: cuobjdump reads the compiled kernels, no GPU needed):
each bf16 GEMM kernel instantiation moe_gemm_kernel<MODE, ACT, WEIGHTS> reads its B tiles in the majorness its mode and
weight form call for, keeps its accumulators in registers, and exists for every form the host can pick. The mode and
form numbers are read from the kernel source, the one place they are defined."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from prime_kernels_core import release

CUDA_SOURCES = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
KERNEL = re.compile(r"moe_gemm_kernelILi(\d+)ELi(\d+)ELi(\d+)E")


def _enum(source: str, head: str) -> dict[str, int]:
    """The enumerators of the `enum HEAD : int { A = 0, ... }` in csrc/cuda/SOURCE."""
    body = re.search(re.escape(head) + r" : int \{([^}]*)\}", (CUDA_SOURCES / source).read_text()).group(1)
    return {k: int(v) for k, v in re.findall(r"(\w+) = (\d+)", body)}


def _modes():
    return _enum("fused_moe_sm90.cu", "enum Mode")


def _forms():
    return _enum("fused_moe_sm90.cu", "enum WeightForm")


def _activations():
    return _enum("sm90_common.cuh", "enum")


@pytest.fixture(scope="module")
def kernels() -> dict[tuple[int, int, int], str]:
    """(MODE, ACT, WEIGHTS) -> the SASS of that instantiation, from the installed extension's sm_90a cubin."""
    tool = release._cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump found (triton's, the CUDA toolkit's or the PATH's)")
    spec = importlib.util.find_spec("prime_kernels_flash_moe._C")
    if spec is None or spec.origin is None:
        pytest.skip("prime_kernels_flash_moe._C is not installed")
    sass = subprocess.run([tool, "-sass", "-arch", "sm_90a", spec.origin], capture_output=True, text=True).stdout
    found = {}
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        match = KERNEL.search(function.split("\n", 1)[0])
        if match:
            found[tuple(int(g) for g in match.groups())] = function
    if not found:
        pytest.skip("the installed flash_moe holds no sm_90a code (a CPU-only build)")
    return found


def test_b_tiles_flip_majorness_with_transposed_weights(kernels):
    modes, forms = _modes(), _forms()
    backward = {modes["DH_SWIGLU"], modes["DX_ATOMIC"], modes["DX_SLOTS"]}
    for (mode, act, weights), sass in kernels.items():
        wgmmas = re.findall(r"HGMMA\.64x256x16\.F32\.BF16[^;]*", sass)
        assert wgmmas, f"moe_gemm_kernel<{mode}, {act}, {weights}> has no m64n256k16 bf16 wgmma"
        n_major = (mode in backward) != (weights != forms["kOutIn"])
        transposed_b = {".tnspB" in w for w in wgmmas}
        assert transposed_b == {n_major}, (
            f"moe_gemm_kernel<{mode}, {act}, {weights}>: expected every wgmma with B "
            f"{'N-major (.tnspB)' if n_major else 'K-major'}, found {sorted(transposed_b)}")


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
