"""One line per kernel launch from Nsight Compute's CSV of gpu_check.sh's hbm phase (never a test): time, HBM bytes
read and written, L2 hit rate; what a GEMM reads from HBM against what it needs says whether L2 reuse is its limit
(docs/notes/flash_moe.md, "L2 or HBM at DeepSeek-V3?").

    ncu --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
        lts__t_sector_hit_rate.pct ... | python bench/diagnostics/ncu_hbm.py
"""
from __future__ import annotations

import csv
import sys

METRICS = "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct"


def main():
    rows = list(csv.DictReader(line for line in sys.stdin if line.startswith('"')))
    launches = {}
    for row in rows:
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        launch[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    if not launches:
        sys.exit("ncu_hbm: no metric rows in the input (did ncu profile any kernel?)")
    for launch_id, m in launches.items():
        print(f"{launch_id:>3} {m.get('gpu__time_duration.sum', 0) / 1e6:8.3f} ms  HBM read "
              f"{m.get('dram__bytes_read.sum', 0) / 1e9:6.2f} GB  write {m.get('dram__bytes_write.sum', 0) / 1e9:5.2f} GB"
              f"  L2 hit {m.get('lts__t_sector_hit_rate.pct', 0):5.1f} %  {m['kernel'][:70]}")


if __name__ == "__main__":
    main()
