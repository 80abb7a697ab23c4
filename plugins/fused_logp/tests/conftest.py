"""Shared by the plugin's suites: every test runs seeded (printed) with uninitialised memory poisoned."""
from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded_and_poisoned(request):
    """Seed per test from the suite's SEED (printed) and fill every uninitialised allocation with NaN, so an unwritten
    output shows. The test name enters through crc32, not hash(), so the printed seed replays in a new process."""
    seed = (request.module.SEED + zlib.crc32(request.node.name.encode())) % 2**31
    torch.manual_seed(seed)
    print(f"[{request.node.name}] seed {seed}")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        # The GPU harness runs every plugin's suite at once on one GPU: memory this suite's largest cases cached
        # (about 130 GB at N = 65536, V = 151936) would starve the others.
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
