"""The end of ``scripts/test.sh``: counts and the ten slowest tests of its pytest runs.

Reads the JUnit XML files each pytest pass wrote (``--junitxml``); a suite run as a
parallel pass and a serial pass gets one list for both.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(paths: list[str]) -> None:
    cases: list[tuple[float, str]] = []
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        if not Path(path).is_file():
            continue
        root = ET.parse(path).getroot()  # noqa: S314
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, "0"))
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time", "0") or 0), name))
    if not cases:
        return
    print("[test.sh] ten slowest tests:")
    for secs, name in sorted(cases, reverse=True)[:10]:
        print(f"  {secs:8.2f}s  {name}")
    print("[test.sh] " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
