"""The conformance kit's fuzz sweep judges what a case returns against the plugin's reference, and an error by whether
it names the argument that was replaced (issue 61, item 4): a plugin that gets either wrong fails its sweep."""
import pytest

from prime_kernels_core import fuzz

TARGETS = '''
import torch


def _check(x, factor):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"scale: x must be a floating-point tensor, got {type(x).__name__}")
    if isinstance(factor, bool) or not isinstance(factor, float):
        raise TypeError(f"scale: factor must be a float, got {type(factor).__name__}")


def scale(x, factor):
    _check(x, factor)
    return x * factor


def scale_reference(x, factor):
    return x * factor


def float64_in_float32(x, factor):  # a careless kernel: float64 inputs computed in float32
    _check(x, factor)
    return (x.float() * factor).to(x.dtype)


def nan_for_zero(x, factor):  # a careless kernel: 0 / 0 where the reference has 0
    _check(x, factor)
    return x * factor * (torch.ones_like(x) * factor / factor)


def blames_x(x, factor):
    if not isinstance(factor, float):
        raise TypeError(f"scale: x needs a float multiplier, got {type(factor).__name__}")
    _check(x, factor)
    return x * factor


def cpu_targets():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    return {name: (fn, dict(x=x, factor=0.7)) for name, fn in
            [("scale", scale), ("float64_in_float32", float64_in_float32), ("nan_for_zero", nan_for_zero),
             ("blames_x", blames_x)]}


def references():
    return {name: (scale_reference, 1.0) for name in ("scale", "float64_in_float32", "nan_for_zero")}
'''


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> dict:
    """{target: its failures} from one sweep (one child process) over every target above."""
    target_file = tmp_path_factory.mktemp("fuzz") / "targets.py"
    target_file.write_text(TARGETS)
    found = {}
    for failure in fuzz.sweep(str(target_file), "cpu", workers=1):
        found.setdefault(failure.split("|")[0], []).append(failure)
    return found


def test_a_correct_target_with_a_reference_passes(failures):
    assert "scale" not in failures, failures["scale"]


def test_a_wrong_value_fails(failures):
    (wrong,) = failures["float64_in_float32"]
    assert wrong.startswith("float64_in_float32|x|") and "(as torch.float64): returned a wrong value: output 0" in wrong


def test_nan_where_the_reference_has_none_fails(failures):
    wrong = failures["nan_for_zero"]
    assert all(f.startswith("nan_for_zero|factor|") for f in wrong), wrong
    assert any("(0): returned a wrong value: output 0's isnan() differs from the reference's" in f for f in wrong)


def test_an_error_must_name_the_argument_replaced(failures):
    blamed = failures["blames_x"]
    assert blamed and all(f.startswith("blames_x|factor|") for f in blamed), blamed
    assert all("the message does not name factor, the argument replaced: TypeError: scale: x needs a float" in f for f in blamed)
