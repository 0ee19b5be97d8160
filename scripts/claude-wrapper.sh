#!/bin/sh
# Put `claude` on PATH: a two-line wrapper that runs agentbox's pinned Claude Code binary,
# for the host's own Claude Code (`claude mcp add agentbox …` in the tutorials).
#   usage: scripts/claude-wrapper.sh BINARY [WRAPPER]     (WRAPPER: /usr/local/bin/claude)
# Called by scripts/setup.sh. Idempotent. Never replaces a `claude` that is not its own
# wrapper (a Claude Code the user installed elsewhere wins): it says so and leaves it.
set -eu
bin=${1:?usage: claude-wrapper.sh BINARY [WRAPPER]}
wrapper=${2:-/usr/local/bin/claude}
mark="# agentbox: the pinned Claude Code (written by scripts/setup.sh)"

[ -x "$bin" ] || { echo "claude-wrapper.sh: no executable Claude Code at $bin" >&2; exit 1; }
if [ -e "$wrapper" ] || [ -L "$wrapper" ]; then
  if ! [ -f "$wrapper" ] || [ -L "$wrapper" ] || ! grep -qxF "$mark" "$wrapper"; then
    echo "claude-wrapper.sh: $wrapper is not agentbox's wrapper: left alone (agentbox's Claude Code: $bin)" >&2
    exit 0
  fi
fi
want=$(printf '#!/bin/sh\n%s\nexec "%s" "$@"\n' "$mark" "$bin")
if [ "$(cat "$wrapper" 2>/dev/null)" != "$want" ]; then
  mkdir -p "$(dirname "$wrapper")"
  tmp="$wrapper.agentbox-tmp.$$"
  printf '%s\n' "$want" > "$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$wrapper"
  echo "claude-wrapper.sh: $wrapper runs $bin" >&2
fi
