#!/usr/bin/env bash
# Run the whole test suite on a Debian 12 host, as root: set-up first (idempotent),
# the default image (cached by content hash), lint and types, then pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/agentbox image build
# podman, QEMU and Claude Code are installed by setup.sh: their tests must run, not skip.
export AGENTBOX_REQUIRE=${AGENTBOX_REQUIRE-podman,qemu,claude,docker}
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
.venv/bin/mypy
.venv/bin/pytest "$@"
