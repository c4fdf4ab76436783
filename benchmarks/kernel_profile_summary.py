"""A markdown table of the main Nsight Compute metrics per kernel launch, from the details
page that ``kernel_profile.sh`` writes (``ncu --import ... --page details``).

    python benchmarks/kernel_profile_summary.py DETAILS.txt[.gz] > profile.md
"""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

METRICS = [  # (column, metric name, unit as ncu prints it)
    ("µs", "Duration", "us"),
    ("DRAM %", "DRAM Throughput", "%"),
    ("TB/s", "Memory Throughput", "Tbyte/s"),
    ("SM %", "Compute (SM) Throughput", "%"),
    ("issue busy %", "Issue Slots Busy", "%"),
    ("regs", "Registers Per Thread", "register/thread"),
    ("occupancy %", "Achieved Occupancy", "%"),
    ("cycles per issue", "Warp Cycles Per Issued Instruction", "cycle"),
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
        for column, name, unit in METRICS:
            for line in body:
                m = re.match(rf"\s+{re.escape(name)}\s+{re.escape(unit)}\s+([\d,.]+)\s*$", line)
                if m:
                    launch[column] = m.group(1).replace(",", "")
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
