"""The end of ``scripts/test.sh``: counts, the ten slowest tests and the ten slowest
modules (the sum of their tests' times: under ``--dist loadfile`` a module is one worker's
unit of work, so the longest bound the parallel pass) of its pytest runs.

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
    modules: dict[str, float] = {}
    for secs, name in cases:
        module = name.split("::", 1)[0]
        modules[module] = modules.get(module, 0.0) + secs
    print(f"[test.sh] ten slowest modules (all tests: {sum(modules.values()):.0f} s):")
    for module, secs in sorted(modules.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {secs:8.2f}s  {module}")
    print("[test.sh] " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
