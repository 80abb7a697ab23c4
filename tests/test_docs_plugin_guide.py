"""docs/writing-a-plugin.md's reference parts against the code they describe (issue 61, item 16)."""
import re
from pathlib import Path

from prime_kernels_core.manifest import arch_runs_on

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "writing-a-plugin.md").read_text()
STABLE_H = (ROOT / "prime_kernels_core" / "include" / "prime_kernels" / "stable.h").read_text()


def _section(title_start: str) -> str:
    start = GUIDE.index(f"\n## {title_start}")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end > 0 else None]


def test_every_stable_h_name_the_guide_lists_is_in_the_header_and_every_function_of_it_is_listed():
    table = _section("11.").split("**`<prime_kernels/stable.h>`**")[1].split("\n\n**")[0]
    listed = {name for cell in re.findall(r"^\| (.+?) \|", table, re.M) for name in re.findall(r"`(\w+)", cell)}
    listed -= {"name"}
    declared = set(re.findall(r"^(?:inline|\[\[noreturn\]\] void|using) [\w:<>&\s]*?\b(\w+)\s*[(=]", STABLE_H, re.M))
    declared |= set(re.findall(r"^#define (\w+)", STABLE_H, re.M))
    assert listed - declared == set(), f"the guide names {sorted(listed - declared)}, which stable.h does not declare"
    assert declared - listed == set(), f"stable.h declares {sorted(declared - listed)}, which the guide does not list"


def test_the_generic_archs_the_guide_recommends_cover_sm80_to_sm121():
    archs = re.search(r'archs = \["8\.0", "9\.0", "10\.0", "11\.0",\s*"12\.0"\]', _section("11."))[0]
    archs = re.findall(r'"([0-9.]+)"', archs)
    for capability in [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]:
        assert any(arch_runs_on(a, capability) for a in archs), capability


def test_the_guide_covers_what_a_plugin_author_asked():
    section = " ".join(_section("11.").split())
    for topic in ("STABLE_TORCH_LIBRARY_FRAGMENT", "pip install -e", "is a source tree with no build",
                  "max_ratio", "compute-sanitizer --tool memcheck", "pytest -m gpu"):
        assert topic in section, topic
