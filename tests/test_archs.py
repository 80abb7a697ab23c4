"""docs/archs.md's table of what runs where, row by row, against the rule gating and the build kit use."""
import re
from pathlib import Path

import pytest

from prime_kernels_core.manifest import GPU_CAPABILITIES, arch_runs_on

TABLE = Path(__file__).resolve().parents[1] / "docs" / "archs.md"


def _rows():
    lines = [line for line in TABLE.read_text().splitlines() if line.startswith("| `") or line.startswith("| built for")]
    header, *body = lines
    names = [name.strip() for name in header.strip("|").split("|")[1:]]
    devices = [tuple(int(x) for x in re.fullmatch(r"sm_(\d+)(\d)", name).groups()) for name in names]
    for line in body:
        arch, *cells = [c.strip() for c in line.strip("|").split("|")]
        yield arch.strip("`"), dict(zip(devices, (c == "runs" for c in cells)))


@pytest.mark.parametrize("arch,runs_on", list(_rows()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_row_of_the_table(arch, runs_on):
    assert tuple(runs_on) == GPU_CAPABILITIES  # a column per GPU generation the build kit describes, in its order
    assert {d: arch_runs_on(arch, d) for d in runs_on} == runs_on


def test_the_table_covers_sm75_to_sm121():
    archs = [arch for arch, _ in _rows()]
    assert {"7.5", "8.0", "8.6", "8.9", "9.0", "9.0a", "10.0a", "10.0f", "11.0", "12.0a", "12.0f", "12.1a"} <= set(archs)
