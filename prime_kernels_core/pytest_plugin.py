"""pytest plugin (entry point ``pytest11``): ``@pytest.mark.kernel(name)`` and ``@pytest.mark.gpu``.

- ``kernel(name, device=None)`` skips the test with the kernel's unavailable_reason on that device (None: the
  current CUDA device; "cpu": the CPU implementation).
- ``gpu`` skips the test unless a CUDA device is visible; the GPU harness runs ``pytest -m gpu``.
"""
import pytest

from . import registry


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel(name, device=None): skip unless the kernel can run on device")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_runtest_setup(item):
    for marker in item.iter_markers("kernel"):
        reason = registry.unavailable_reason(marker.args[0], marker.kwargs.get("device"))
        if reason:
            pytest.skip(reason)
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device; none is visible")
