"""A markdown table of the main Nsight Compute metrics per kernel launch, from the details
page that ``kernel_profile.sh`` writes (``ncu --import ... --page details``).

    python benchmarks/kernel_profile_summary.py DETAILS.txt[.gz] > profile.md
"""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

METRICS = [  # (column, metric name, {unit as ncu prints it: factor to the column's unit})
    ("µs", "Duration", {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}),
    ("DRAM %", "DRAM Throughput", {"%": 1.0}),
    ("TB/s", "Memory Throughput", {"Mbyte/s": 1e-6, "Gbyte/s": 1e-3, "Tbyte/s": 1.0}),
    ("SM %", "Compute (SM) Throughput", {"%": 1.0}),
    ("issue busy %", "Issue Slots Busy", {"%": 1.0}),
    ("regs", "Registers Per Thread", {"register/thread": 1.0}),
    ("occupancy %", "Achieved Occupancy", {"%": 1.0}),
    ("cycles per issue", "Warp Cycles Per Issued Instruction", {"cycle": 1.0}),
]
_LAUNCH = re.compile(r"^  (\w+) \(([\d, ]+)\)x\(([\d, ]+)\)")
_STALL = re.compile(r"spends ([\d.]+) cycles being stalled waiting for (.*?) This stall type "
                    r"represents about ([\d.]+)%")  # fmt: skip


def launches(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        m = _LAUNCH.match(line)
        if m:
            out.append({"kernel": m.group(1), "grid": m.group(2), "block": m.group(3), "_": []})
        elif out:
            out[-1]["_"].append(line)
    for launch in out:
        body = launch.pop("_")
        for column, name, units in METRICS:
            for line in body:
                m = re.match(rf"\s+{re.escape(name)}\s+(\S+)\s+([\d,.]+)\s*$", line)
                if m and m.group(1) in units:
                    launch[column] = f"{float(m.group(2).replace(',', '')) * units[m.group(1)]:.4g}"
                    break
        joined = " ".join(x.strip() for x in body)
        stall = _STALL.search(joined)
        if stall:
            what = stall.group(2).split(". ")[0].strip().rstrip(".")
            launch["top stall"] = f"{what}: {stall.group(1)} cycles ({stall.group(3)}%)"
    return out


def main() -> None:
    path = Path(sys.argv[1])
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    columns = ["kernel", "grid", "block", *(c for c, _, _ in METRICS), "top stall"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for launch in launches(raw.decode()):
        print("| " + " | ".join(launch.get(c, "") for c in columns) + " |")


if __name__ == "__main__":
    main()
