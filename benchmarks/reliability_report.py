"""Print the reliability suite's figures as the Markdown table of docs/reliability.md.

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
    print("| run | operations | faults injected | crash cycles | blocks verified "
          "| blocks lost | wrong blocks served |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        injected = r.get("faults_injected", {})
        faults.update(injected)
        row = {
            "operations": r.get("operations", r.get("requests", 0)),
            "faults": sum(injected.values()),
            "cycles": r.get("crash_cycles", 0),
            "verified": r.get("blocks_verified", 0),
            "lost": r.get("blocks_lost", 0),
            "wrong": r.get("wrong_blocks_served", 0),
        }
        total.update(row)
        print(f"| {name} | {row['operations']} | {row['faults']} | {row['cycles']} "
              f"| {row['verified']} | {row['lost']} | {row['wrong']} |")
    print(f"| **total** | {total['operations']} | {total['faults']} | {total['cycles']} "
          f"| {total['verified']} | {total['lost']} | {total['wrong']} |")
    print()
    print("Faults injected by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    for name, r in runs.items():
        extra = {k: v for k, v in r.items() if k not in {
            "operations", "faults_injected", "crash_cycles", "blocks_verified",
            "blocks_lost", "wrong_blocks_served"}}
        if extra:
            print(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(extra.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".reports/reliability")))
