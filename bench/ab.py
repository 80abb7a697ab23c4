"""Same-machine A/B of plugin builds (never a test): one benchmark script, run once per build per round.

    python bench/ab.py [--json PATH] [--rounds N] [--variant NAME=SITE_DIR ...] -- BENCH [BENCH ARGS]

The installed tree is the variant "tree"; every --variant is a ``pip install --target SITE_DIR`` build of another
revision (``scripts/stage_variant.sh``), put first on PYTHONPATH, where the registry takes the first copy of a
distribution. Each run is a fresh process; the order rotates every round so that clock drift over the call does not
favour one build. For every timing (a ``*_ms`` field in BENCH's JSON) it prints the median over rounds per build and
the ratio to "tree"; the ceilings each run measured are printed beside them (they drift by a few percent per call).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


# The fields that name a benchmark row (never a measurement: peak bytes and the like change from run to run).
ROW_KEYS = ("shape", "impl", "transform", "dtype", "N", "H", "V", "T", "rank")


def row_label(row: dict) -> tuple:
    ids = [str(row[k]) for k in ROW_KEYS if k in row and not isinstance(row[k], (dict, list))]
    return (" ".join(ids),) if ids else ()


def timings(report, path=(), in_list=False):
    """(row label, field) -> ms for every *_ms field, and for each entry of a *_ms dict of numbers (a timeline's
    kernels_ms: name -> ms, the entry's name as the field); rows in a list (or with a 'shape') named by row_label,
    nested dicts by their key."""
    found = {}
    if isinstance(report, dict):
        label = path + (row_label(report) if in_list or "shape" in report else ())
        for key, value in report.items():
            if key.endswith("_ms") and isinstance(value, (int, float)):
                found[(" / ".join(label) or "-", key)] = float(value)
            elif key.endswith("_ms") and isinstance(value, dict) and all(
                    isinstance(v, (int, float)) for v in value.values()):
                found.update({(" / ".join(label + (key,)), name): float(v) for name, v in value.items()})
            elif isinstance(value, (dict, list)):
                found.update(timings(value, label + (key,)))
    elif isinstance(report, list):
        for item in report:
            found.update(timings(item, path, in_list=True))
    return found


def run_once(bench: list[str], site_dir: str | None) -> dict:
    env = dict(os.environ)
    if site_dir:
        env["PYTHONPATH"] = site_dir + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        subprocess.run([sys.executable, bench[0], *bench[1:], "--json", report.name], env=env, check=True)
        with open(report.name) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="NAME=SITE_DIR")
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    variants = [("tree", None)] + [tuple(v.split("=", 1)) for v in args.variant]
    runs = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, site_dir in variants[r % len(variants):] + variants[: r % len(variants)]:
            print(f"[ab] round {r + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append(run_once(bench, site_dir))
    medians = {}
    for name, reports in runs.items():
        per_key = {}
        for report in reports:
            for key, ms in timings(report).items():
                per_key.setdefault(key, []).append(ms)
        medians[name] = {key: statistics.median(v) for key, v in per_key.items()}
        ceilings = sorted({f"{k}={v:.0f}" for rep in reports for k, v in rep.items()
                           if k.endswith("ceiling_tflops") and v is not None})  # None: a ceiling the run skipped
        print(f"[ab] {name}: ceilings seen (TFLOP/s) {', '.join(ceilings)}")
    names = [name for name, _ in variants]
    rows = list(medians["tree"])
    w_row = min(64, max([len("row")] + [len(key[0]) for key in rows]))
    w_timing = min(64, max([len("timing")] + [len(key[1]) for key in rows]))
    print(f"| {'row':{w_row}s} | {'timing':{w_timing}s} | " + " | ".join(f"{n:>16s}" for n in names) + " |")
    for key in rows:
        base = medians["tree"][key]
        cells = [f"{base:9.3f} ms"] + [
            f"{medians[n][key]:8.3f} x{medians[n][key] / base:5.3f}" if key in medians[n] else "-" for n in names[1:]
        ]
        print(f"| {key[0][:w_row]:{w_row}s} | {key[1][:w_timing]:{w_timing}s} | " + " | ".join(f"{c:>16s}" for c in cells)
              + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": bench, "rounds": args.rounds, "runs": runs,
                       "medians": {n: [[*k, v] for k, v in m.items()] for n, m in medians.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
