#!/usr/bin/env bash
# The offline demo (README command (a)). On a fresh Debian 12 host, as root:
#   1. set everything up (scripts/setup.sh: podman, runc, Claude Code, the venv);
#   2. build the default sandbox image (cached by content hash: quick the 2nd time);
#   3. make a small sample Python repo (from demo/sample-repo) under the repos root;
#   4. delegate a real task to the real Claude Code binary in the hardened podman
#      sandbox, through its own metered gateway; the model is the built-in
#      `replay-demo`, a SCRIPTED model (no network, no API key) that plays the
#      tool calls a model would make: write a helper and its test, run the tests;
#   5. print the report and the result branch's diff.
# Idempotent: every run recreates the sample repo and runs a new task.
# For a real model: agentbox run --repo PATH --model sonnet "…" with ANTHROPIC_API_KEY set
# on the host (it stays on the host: the sandbox only ever sees a one-time token).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
say() { printf '\n\033[1m[demo]\033[0m %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "demo.sh: run as root (the launcher drives podman as root)" >&2; exit 2; }

say "setting up (idempotent)"
bash scripts/setup.sh

AB="$here/.venv/bin/agentbox"
PY="$here/.venv/bin/python"

say "building the default sandbox image (cached when unchanged)"
if ! "$AB" image build; then
  echo "demo.sh: agentbox image build failed" >&2
  exit 1
fi

repos_root=$("$PY" -c 'from agentbox.config import load_settings; print(load_settings().repos_root)')
repo="$repos_root/agentbox-demo"
if [ -e "$repo" ] && [ ! -f "$repo/.agentbox-demo" ]; then
  echo "demo.sh: $repo exists and is not the demo's sample repo; move it away first" >&2
  exit 1
fi
say "creating the sample repo $repo"
rm -rf "$repo"
mkdir -p "$repo"
cp -R demo/sample-repo/. "$repo/"
touch "$repo/.agentbox-demo"
git -C "$repo" init -q -b main
git -C "$repo" add -A
git -C "$repo" -c user.name="agentbox demo" -c user.email=demo@localhost \
    -c commit.gpgsign=false commit -q -m "Sample repo for the agentbox demo"

task_id="demo-$(date +%Y%m%d-%H%M%S)-$$"
say "delegating the task (model: replay-demo, scripted and offline) as $task_id"
printf '  %s\n' "$(cat demo/task.txt)" >&2
status=0
"$AB" run --repo "$repo" --model replay-demo --deadline 600 --id "$task_id" \
    "$(cat demo/task.txt)" || status=$?

say "the result is a branch in the sample repo:"
git -C "$repo" --no-pager log --oneline -n 2 "agentbox/$task_id" || true
git -C "$repo" --no-pager diff --stat "main" "agentbox/$task_id" || true
say "review it with: git -C $repo diff main agentbox/$task_id   ·   agentbox show $task_id"
say "the model was scripted (replay-demo); for a real one: --model sonnet with ANTHROPIC_API_KEY set"
exit "$status"
