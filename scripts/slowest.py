"""The suite's slowest files and tests, from the last run of scripts/test.sh (its JUnit report, test-results/last.xml).

    python scripts/slowest.py [REPORT.xml] [--files N] [--tests N]

Per file: the seconds its tests took (setup, call and teardown; under two workers, so a file's time includes waiting for
the machine's cores) and its share of the whole; then the slowest tests. Every issue that adds tests can see what it added.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPORT = Path(__file__).resolve().parent.parent / "test-results" / "last.xml"


def read(report: Path) -> tuple[list[tuple[float, str, str, str]], dict]:
    """[(seconds, file, test, outcome)] and the run's totals (tests, failures, errors, skipped, time)."""
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        cases.append((float(case.get("time") or 0), Path(file).name, case.get("name", ""), outcome))
    totals = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time", "timestamp")}
    return cases, totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", type=Path, default=REPORT, help=f"a JUnit XML report (default {REPORT})")
    parser.add_argument("--files", type=int, default=15, help="how many files to list")
    parser.add_argument("--tests", type=int, default=25, help="how many tests to list")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"error: {args.report}: no report; run bash scripts/test.sh first (it writes it)", file=sys.stderr)
        return 2
    cases, totals = read(args.report)
    whole = sum(t for t, *_ in cases) or 1.0
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for seconds, file, _, _ in cases:
        per_file[file][0] += seconds
        per_file[file][1] += 1
    print(f"{args.report}: {totals['tests']} tests ({totals['failures']} failed, {totals['errors']} errors, {totals['skipped']} "
          f"skipped) in {float(totals['time'] or 0):.0f} s wall, {whole:.0f} s summed over tests, run {totals['timestamp']}")
    print(f"\n{'seconds':>8} {'share':>6} {'tests':>6}  file")
    for file, (seconds, count) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[: args.files]:
        print(f"{seconds:8.1f} {seconds / whole:6.1%} {count:6d}  {file}")
    print(f"\n{'seconds':>8}  test")
    for seconds, file, name, outcome in sorted(cases, reverse=True)[: args.tests]:
        print(f"{seconds:8.1f}  {file}::{name}{'' if outcome == 'passed' else f'  ({outcome})'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
