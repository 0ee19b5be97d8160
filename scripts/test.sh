#!/usr/bin/env bash
# Run the test suite on a Debian 12 host, as root: set-up first (idempotent), lint and
# types, then pytest. Prints its total time and the ten slowest tests at the end.
#
#   scripts/test.sh           the whole suite (README command (b); .ci/run calls it): the
#                             default image (cached by content hash), then every test not
#                             marked `serial` on AGENTBOX_TEST_WORKERS xdist workers (default
#                             3 on 2 cores: with the modules in order, 4 kept the CPU 95 %
#                             busy and timing-bound tests flaked), one module per worker, the
#                             longest modules first, then the `serial` ones alone
#                             (tests/conftest.py: SERIAL, SERIAL_TESTS, SERIAL_DIRS)
#   scripts/test.sh --fast    the unit tier only (pure: no root, no sandbox, no service),
#                             with ruff and mypy, on every core: under 2 minutes
#   scripts/test.sh ARGS…     pytest ARGS… as given, serial (e.g. tests/unit -x)
#
# AGENTBOX_TEST_WORKERS=0 runs the whole suite in one serial pass.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
passes=""
fast=0
if [ "${1-}" = --fast ]; then fast=1; shift; fi

bash scripts/setup.sh
report=$(mktemp -d /tmp/agentbox-test-report.XXXXXX)
# A short base for tmp_path: xdist adds popen-gwN/ to every test's dir, and a sandbox's
# unix sockets under it must stay within AF_UNIX's 108 bytes. Private to this run.
bt=$(mktemp -d /tmp/abt.XXXX)
summary() {
  local rc=$?
  .venv/bin/python scripts/test_summary.py "$report"/*.xml 2>/dev/null || true
  echo "[test.sh] total $((SECONDS - start)) s (exit $rc)${passes:+: $passes}"
  rm -rf "$report" "$bt"
}
trap summary EXIT

.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench

if [ $fast = 1 ]; then
  # mypy beside the unit tests (its ~15 s uncached is most of a fresh clone's wait for it).
  .venv/bin/mypy > "$report/mypy.txt" 2>&1 &
  typing=$!
  rc=0
  .venv/bin/pytest tests/unit -n auto -p no:cacheprovider --basetemp="$bt/u" \
    --junitxml="$report/unit.xml" "$@" || rc=$?
  if ! wait $typing; then cat "$report/mypy.txt"; [ $rc -ne 0 ] || rc=1; fi
  exit $rc
fi
.venv/bin/mypy

.venv/bin/agentbox image build
# podman, QEMU and Claude Code are installed by setup.sh: their tests must run, not skip.
export AGENTBOX_REQUIRE=${AGENTBOX_REQUIRE-podman,qemu,claude,docker,gitlfs,chromium}
if [ $# -gt 0 ]; then
  .venv/bin/pytest --junitxml="$report/run.xml" "$@"
  exit
fi
workers=${AGENTBOX_TEST_WORKERS-3}
if [ "$workers" = 0 ]; then
  .venv/bin/pytest --junitxml="$report/run.xml"
  exit
fi
# The share of the host's CPU time that was busy (not idle or waiting on I/O) since a
# snapshot: is a pass bound by the cores or by waiting?
cpu() { awk '/^cpu /{t=0; for(i=2;i<=NF;i++) t+=$i; print t, $5+$6}' /proc/stat; }
busy() { local now; now=$(cpu); awk -v a="$1" -v b="$now" 'BEGIN{split(a,x," "); split(b,y," ");
  d=y[1]-x[1]; printf "%d%%", (d > 0 ? 100*(d-(y[2]-x[2]))/d : 0)}'; }
rc=0
t=$SECONDS
c=$(cpu)
.venv/bin/pytest -n "$workers" --dist loadfile -m "not serial" --basetemp="$bt/p" \
  --junitxml="$report/parallel.xml" || rc=$?
passes="parallel pass ($workers workers) $((SECONDS - t)) s, CPU $(busy "$c") busy"
t=$SECONDS
c=$(cpu)
.venv/bin/pytest -m serial --junitxml="$report/serial.xml" || rc=$((rc ? rc : $?))
passes+=", serial pass $((SECONDS - t)) s, CPU $(busy "$c") busy"
exit $rc
