"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page (never a test): gpu_check.sh's
profile phase writes it as profile_sass.csv and this summary beside it as profile_sass.txt.

    python bench/diagnostics/ncu_sass.py profile_sass.csv [--top 12]

Per profiled launch: its warp-state samples, the share spent in the consumers' wait for a stage's data (the try-wait
loop on the full mbarrier just before the first wgmma: a mainloop starved for loads shows here; docs/notes/flash_moe.md,
"where the GEMM kernels wait"), and the instructions holding the most samples with their two largest stall reasons.
"""
from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def launches(path):
    """(kernel name, header, rows) per launch; ncu repeats a launch's table, kept once."""
    found, seen = [], set()
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                found.append([row[1], None, []])
            elif row and row[0] == "Address" and found:
                found[-1][1] = row
            elif found and found[-1][1] and len(row) == len(found[-1][1]):
                found[-1][2].append(row)
    for name, header, rows in found:
        key = (name, tuple(r[0] for r in rows[:8]), len(rows))
        if header and rows and key not in seen:
            seen.add(key)
            yield name, header, rows


def full_barrier_wait(rows, column):
    """Samples on the branch of the last try-wait loop before the first wgmma (0 when the kernel has none)."""
    first_mma = next((i for i, r in enumerate(rows) if "GMMA" in r[1]), None)
    if first_mma is None:
        return 0
    waits = [i for i in range(first_mma) if "TRYWAIT" in rows[i][1]]
    if not waits:
        return 0
    branch = next((i for i in range(waits[-1], first_mma) if "BRA" in rows[i][1]), None)
    return int(rows[branch][column]) if branch is not None else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for name, header, rows in launches(args.csv):
        col = {h: i for i, h in enumerate(header)}
        stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(int(r[col[SAMPLES]]) for r in rows) or 1
        wait = full_barrier_wait(rows, col[SAMPLES])
        print(f"{name}: {len(rows)} SASS, {total} samples; full-barrier wait {100 * wait / total:.1f} %")
        for r in sorted(rows, key=lambda r: -int(r[col[SAMPLES]]))[: args.top]:
            reasons = sorted(((float(r[col[h]] or 0), h[len("stall_"):]) for h in stalls), reverse=True)[:2]
            why = "  ".join(f"{k} {100 * v / total:.1f}" for v, k in reasons if v)
            print(f"  {100 * int(r[col[SAMPLES]]) / total:5.1f} %  {r[1].strip()[:64]:64}  {why}")


if __name__ == "__main__":
    main()
