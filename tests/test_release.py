"""The release's pin lines and wheel checks that need no build: one pin per distribution, platform_machine markers
where a distribution has wheels for several platforms, and the ELF machine each wheel's platform needs."""
from pathlib import Path

import pytest

from prime_kernels_core import release

HOUSE = Path("/wh")
CORE = HOUSE / "prime_kernels_core-0.1.0-py3-none-any.whl"
X86 = HOUSE / "pk_demo-0.1.0+cu130torchabi2.11-cp310-abi3-linux_x86_64.whl"
ARM = HOUSE / "pk_demo-0.1.0+cu130torchabi2.11-cp310-abi3-linux_aarch64.whl"


@pytest.mark.parametrize("wheel,machine", [(CORE, None), (X86, "x86_64"), (ARM, "aarch64"),
                                           (HOUSE / "a-1-cp311-cp311-manylinux_2_28_aarch64.whl", "aarch64")])
def test_wheel_machine(wheel, machine):
    assert release.wheel_machine(wheel) == machine


def test_one_platform_pins_as_before():
    text = release.pin_lines([CORE, X86], HOUSE)
    assert f'pip install --find-links {HOUSE} "prime-kernels-core==0.1.0" "pk-demo==0.1.0+cu130torchabi2.11"' in text
    assert f'pk-demo = {{ path = "{X86}" }}' in text and "marker" not in text


def test_two_platforms_pin_one_version_and_a_file_per_machine():
    text = release.pin_lines([CORE, X86, ARM], HOUSE)
    assert '"pk-demo==0.1.0+cu130torchabi2.11"' in text  # the same version: pip picks the platform's file
    assert f'prime-kernels-core = {{ path = "{CORE}" }}' in text
    assert "\n".join([
        "pk-demo = [",
        f'  {{ path = "{X86}", marker = "platform_machine == \'x86_64\'" }},',
        f'  {{ path = "{ARM}", marker = "platform_machine == \'aarch64\'" }},',
        "]"]) in text


def test_versions_that_differ_per_platform_get_a_marked_requirement_each():
    arm = HOUSE / "pk_demo-0.1.0+cu130torch2.14-cp311-cp311-linux_aarch64.whl"
    text = release.pin_lines([X86, arm], HOUSE)
    assert '"pk-demo==0.1.0+cu130torchabi2.11; platform_machine == \'x86_64\'"' in text
    assert '"pk-demo==0.1.0+cu130torch2.14; platform_machine == \'aarch64\'"' in text
