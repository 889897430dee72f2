"""Print the reliability suite's figures as the Markdown table of docs/lab/reliability-runs.md.

Run ``make reliability`` (which runs the suite, soak included, with
``KVTIER_REPORT_DIR=.reports/reliability``, then this script), or by hand::

    KVTIER_REPORT_DIR=.reports/reliability .venv/bin/python -m pytest tests/reliability -m ''
    .venv/bin/python benchmarks/reliability_report.py .reports/reliability
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def main(where: Path) -> int:
    files = sorted(where.glob("*.json"))
    if not files:
        print(f"no reports in {where}: run the suite with KVTIER_REPORT_DIR set", file=sys.stderr)
        return 1
    runs = {f.stem: json.loads(f.read_text()) for f in files}
    total: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    print(
        "| run | operations | faults injected | kill cycles | bad inputs | blocks verified "
        "| blocks lost | wrong blocks served |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        injected = r.get("faults_injected", {})
        faults.update(injected)
        row = {
            "operations": r.get("operations", r.get("requests")),
            "faults": sum(injected.values()) if injected else None,
            "cycles": r.get("crash_cycles", r.get("shm_cycles")),
            "bad inputs": r.get("bad_inputs_tried"),
            "verified": r.get("blocks_verified"),
            "lost": r.get("blocks_lost"),
            "wrong": r.get("wrong_blocks_served"),
        }
        total.update({k: v for k, v in row.items() if v})
        cells = " | ".join("-" if v is None else str(v) for v in row.values())
        print(f"| {name.removeprefix('test_').rstrip('_')} | {cells} |")
    keys = ("operations", "faults", "cycles", "bad inputs", "verified", "lost", "wrong")
    print("| **total** | " + " | ".join(str(total[k]) for k in keys) + " |")
    print()
    print("Faults injected by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    for name, r in runs.items():
        extra = {
            k: v
            for k, v in r.items()
            if k
            not in {
                "operations",
                "faults_injected",
                "crash_cycles",
                "shm_cycles",
                "blocks_verified",
                "blocks_lost",
                "wrong_blocks_served",
                "bad_inputs_tried",
            }
        }
        if extra:
            print(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(extra.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".reports/reliability")))
