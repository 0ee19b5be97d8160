#!/usr/bin/env bash
# Set up everything agentbox needs on a Debian 12 host, as root. Idempotent and quick
# when already done: each step checks before it acts.
#   - apt: podman, runc, crun, runsc (gVisor), bubblewrap, mmdebstrap, QEMU, busybox, …
#   - a project venv in .venv with agentbox and its dev tools
#   - the pinned Claude Code npm package (native binary) under the data dir
#   - a Docker Engine for the docker backend, unless Docker is already there
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup.sh: run as root (agentbox drives podman and /dev/kvm as root)" >&2; exit 2; }

APT_PKGS=(podman runc crun runsc bubblewrap uidmap mmdebstrap qemu-system-x86 qemu-utils
          busybox-static socat e2fsprogs cpio zstd kmod libcap2-bin git nodejs npm
          python3-venv sqlite3 procps iproute2 util-linux
          xfsprogs   # xfsprogs: the reflink-workspace test's XFS loop filesystem
          strace     # the per-task git process budget test counts execve calls
          git-lfs    # the apply test proves agent-written LFS config never makes the host's git-lfs run
          gcc libc6-dev   # the image build compiles the in-sandbox relay (guest/relay.c), static
          chromium chromium-driver)  # the web view's browser tests (tests/e2e/test_ui_browser.py)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node/npm may come from elsewhere (e.g. a nodesource build); don't fight it.
if command -v node >/dev/null && command -v npm >/dev/null; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
read -r -a missing <<<"${missing[*]}"
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # With recommends, as on the machines this was proven on (podman: catatonit, fuse-overlayfs…).
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The unprivileged MCP server's group: it may use the launcher's socket and read
# result branches from the shadow git dirs of the tasks it delegated.
getent group agentbox >/dev/null || groupadd --system agentbox

# Project venv, re-installed only when pyproject.toml changes.
stamp=.venv/.agentbox-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating .venv and installing agentbox[dev,ray]"
  # A venv made by another interpreter (a pyenv python, then Debian's) is rebuilt from
  # scratch: upgrading it in place leaves a pyvenv.cfg that no longer matches its stdlib.
  clear=
  home=$(python3 -c 'import sys; print(sys.base_prefix)')/bin
  if [ -f .venv/pyvenv.cfg ] && ! grep -qxF "home = $home" .venv/pyvenv.cfg; then clear=--clear; fi
  python3 -m venv $clear .venv
  # Wheels of what the venv needs, kept by content (pyproject.toml, the interpreter, pip's
  # own configuration and constraints): another clone on this host installs from them with
  # no index (~40 s instead of ~70 s, the most of a fresh clone's `test.sh --fast`).
  wheels=/var/cache/agentbox/wheels/$( {
    cat pyproject.toml; python3 -VV; .venv/bin/pip config list 2>/dev/null
    .venv/bin/pip config list 2>/dev/null | sed -n "s/.*constraint='\(.*\)'/\1/p" | xargs -r cat
  } | sha256sum | cut -c1-16)
  if [ -f "$wheels/.complete" ] \
     && .venv/bin/pip install -q --no-index --find-links "$wheels" -U pip >/dev/null \
     && .venv/bin/pip install -q --no-index --find-links "$wheels" -e '.[dev,ray]'; then
    log "installed from the wheel cache $wheels"
  else
    .venv/bin/pip install -q -U pip >/dev/null
    .venv/bin/pip install -q -e '.[dev,ray]'  # ray: the cluster tests (agentbox[ray])
    # The cache for the next clone: a failure here costs only that.
    tmp=$wheels.tmp.$$
    mkdir -p "$(dirname "$wheels")"
    if .venv/bin/pip wheel -q -w "$tmp" '.[dev,ray]' pip hatchling editables >/dev/null 2>&1; then
      rm -f "$tmp"/agentbox-*.whl && touch "$tmp/.complete" && rm -rf "$wheels" && mv "$tmp" "$wheels"
    else
      rm -rf "$tmp"; log "no wheel cache made (pip wheel failed); the next clone installs from the index"
    fi
  fi
  echo "$want" > "$stamp"
fi

# --- BEGIN issue 29: agentbox for members of the group agentbox (not only root) ---
# The project venv's interpreter may live in root's home (pyenv, 0700): a group member
# could not even start the CLI. /opt/agentbox/venv is a venv of the system python3
# (world-readable, root-owned) and /usr/local/bin/agentbox runs it. When this checkout
# and its venv are readable by others, the venv sees them through a .pth (as the cluster's
# /opt/agentbox/node-venv does: edits are live); else agentbox is installed into it.
sdk_venv=/opt/agentbox/venv
if [ ! -x "$sdk_venv/bin/python" ]; then
  log "creating $sdk_venv (agentbox for members of the group agentbox)"
  mkdir -p /opt/agentbox && chmod 0755 /opt/agentbox
  /usr/bin/python3 -m venv --without-pip "$sdk_venv"
fi
sdk_site=$("$sdk_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
proj_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if runuser -u nobody -- test -r "$proj_site" -a -x "$proj_site" -a -r "$PWD/src/agentbox/__init__.py"; then
  echo "import site; site.addsitedir('$proj_site')" > "$sdk_site/agentbox-main.pth"
else
  rm -f "$sdk_site/agentbox-main.pth"
  if [ "$(cat "$sdk_venv/.agentbox-installed" 2>/dev/null)" != "$want" ]; then
    log "installing agentbox into $sdk_venv"
    /usr/bin/python3 -m venv --upgrade-deps "$sdk_venv" >/dev/null
    "$sdk_venv/bin/pip" install -q "$PWD" && echo "$want" > "$sdk_venv/.agentbox-installed"
  fi
fi
chmod -R go+rX,go-w "$sdk_venv"
printf '#!/bin/sh\nexec %s/bin/python -m agentbox "$@"\n' "$sdk_venv" > /usr/local/bin/agentbox.new
chmod 0755 /usr/local/bin/agentbox.new && mv -f /usr/local/bin/agentbox.new /usr/local/bin/agentbox
# --- END issue 29 ---

# Root's inotify limits: every podman sandbox's user namespace is owned by root, so the
# kernel charges each sandbox's inotify use to root as well. Each sandbox is capped (an
# OCI hook, backends/oci/_userns_limits.py); root's limits must leave room for many of them.
# Only ever raised, persisted in /etc/sysctl.d; `agentbox doctor` checks them.
.venv/bin/python -c 'from agentbox.backends.oci._userns_limits import HOST_SYSCTLS as h
print("\n".join(f"{k} = {v}" for k, v in h.items()))' | while read -r key _ want; do
  have=$(sysctl -n "$key" 2>/dev/null || echo 0)
  if [ "$have" -lt "$want" ]; then
    log "sysctl $key=$want (was $have)"
    sysctl -q -w "$key=$want"
    conf=/etc/sysctl.d/60-agentbox.conf
    touch "$conf"
    sed -i "/^$key *=/d" "$conf"
    echo "$key = $want" >> "$conf"
  fi
done

# Docker Engine for the docker backend (docs/reference/docker-backend.md). A daemon that
# answers, or a Docker installation that is not Debian's docker.io, is left alone. Else:
# Debian's docker.io, our daemon.json (userns-remap onto the sandbox ids, runsc and
# runsc-gw with gVisor's network off) when there is none, and dockerd without iptables
# or a bridge (sandboxes have no network).
docker_up() { .venv/bin/python -c 'import docker; docker.APIClient(version="1.41", timeout=5).ping()' >/dev/null 2>&1; }
# dockerd's live-restore: detached sandboxes outlive a daemon restart (run-as-a-service.md).
# Added to a daemon.json of ours (userns-remap dockremap) written before it; a running
# dockerd reloads it on SIGHUP, without a restart.
live_restore() {
  [ -e /etc/docker/daemon.json ] || return 0
  .venv/bin/python - <<'PY' || return 0
import json, sys
p = "/etc/docker/daemon.json"
d = json.load(open(p))
if d.get("userns-remap") != "dockremap" or "live-restore" in d:
    sys.exit(1)
d["live-restore"] = True
open(p + ".tmp", "w").write(json.dumps(d, indent=2) + "\n")
__import__("os").replace(p + ".tmp", p)
PY
  log "docker: live-restore added to /etc/docker/daemon.json"
  pid=$(pidof dockerd || true)
  [ -z "$pid" ] || kill -HUP $pid
}
live_restore
if docker_up; then
  :
elif command -v dockerd >/dev/null && ! dpkg -S "$(command -v dockerd)" 2>/dev/null | grep -q '^docker.io:'; then
  log "docker: an existing Docker installation without a running daemon: left alone"
else
  if ! command -v dockerd >/dev/null; then
    log "apt-get install docker.io"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends docker.io >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io >/dev/null; }
  fi
  base=$(.venv/bin/python -c 'from agentbox.config import load_settings as l; print(l().subid_base)')
  getent passwd dockremap >/dev/null || useradd --system --no-create-home --shell /usr/sbin/nologin dockremap
  grep -q '^dockremap:' /etc/subuid 2>/dev/null || echo "dockremap:$base:65536" >> /etc/subuid
  grep -q '^dockremap:' /etc/subgid 2>/dev/null || echo "dockremap:$base:65536" >> /etc/subgid
  if [ ! -e /etc/docker/daemon.json ]; then
    log "docker: writing /etc/docker/daemon.json (userns-remap, runsc, runsc-gw)"
    mkdir -p /etc/docker
    runsc=$(command -v runsc || echo /usr/bin/runsc)
    cat > /etc/docker/daemon.json <<JSON
{
  "userns-remap": "dockremap",
  "live-restore": true,
  "runtimes": {
    "runsc": {"path": "$runsc", "runtimeArgs": ["--network=none", "--platform=ptrace", "--oci-seccomp"]},
    "runsc-gw": {"path": "$runsc", "runtimeArgs": ["--network=none", "--platform=ptrace", "--oci-seccomp", "--host-uds=open"]}
  }
}
JSON
  fi
  log "docker: starting dockerd --iptables=false --bridge=none (log: /var/log/agentbox-dockerd.log)"
  setsid nohup dockerd --iptables=false --bridge=none >>/var/log/agentbox-dockerd.log 2>&1 </dev/null &
  for _ in $(seq 50); do docker_up && break; sleep 0.4; done
  docker_up || echo "setup.sh: dockerd did not answer; see /var/log/agentbox-dockerd.log" >&2
fi

# >>> private registries and git server for the tests (tests/private_servers.py) >>>
# nginx + fcgiwrap serve `git http-backend` over TLS with basic auth; verdaccio 6.8 (6.10
# wants Node 22) is a private npm registry; pypiserver comes with the dev extras; a host
# user's keyring (the system python's keyring with keyrings.alt's file backend) holds a
# pip index password.
test_pkgs=()
for p in nginx-light fcgiwrap python3-keyring python3-keyrings.alt; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || test_pkgs+=("$p")
done
if [ ${#test_pkgs[@]} -gt 0 ]; then
  log "apt-get install ${test_pkgs[*]} (test servers)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${test_pkgs[@]}" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${test_pkgs[@]}" >/dev/null; }
fi
verdaccio_dir=/opt/agentbox-test/verdaccio
if [ ! -x "$verdaccio_dir/node_modules/.bin/verdaccio" ]; then
  log "npm install verdaccio@6.8.0 (test registry) into $verdaccio_dir"
  mkdir -p "$verdaccio_dir"
  npm install --silent --no-audit --no-fund --prefix "$verdaccio_dir" verdaccio@6.8.0 >/dev/null
fi
# <<< private registries and git server for the tests <<<

# Claude Code, pinned; the native binary lives in its platform package.
ver=$(.venv/bin/python -c 'from agentbox.config import CLAUDE_CODE_VERSION as v; print(v)')
cc=$(.venv/bin/python -c 'from agentbox.config import load_settings as l; print(l().claude_code_dir)')
if [ ! -x "$cc/node_modules/@anthropic-ai/claude-code-linux-x64/claude" ]; then
  log "npm install @anthropic-ai/claude-code@$ver"
  mkdir -p "$cc"
  npm install --silent --no-audit --no-fund --prefix "$cc" "@anthropic-ai/claude-code@$ver" >/dev/null
fi
# GitHub's OpenAPI description (npm @octokit/openapi), pinned: the pull-request tests check
# every request the GitHub client sends against it (tests/forge_servers.py).
# Installed once per host under its pinned version (a fresh clone links to it).
octo_ver=23.0.2
octo=/var/cache/agentbox/npm/octokit-openapi-$octo_ver
if [ ! -f "$octo/node_modules/@octokit/openapi/generated/api.github.com.json" ]; then
  log "npm install @octokit/openapi@$octo_ver (the pull-request tests' API description)"
  rm -rf "$octo.tmp" && mkdir -p "$octo.tmp"
  npm install --silent --no-audit --no-fund --prefix "$octo.tmp" "@octokit/openapi@$octo_ver" >/dev/null
  rm -rf "$octo" && mv "$octo.tmp" "$octo"
fi
mkdir -p .venv/share
[ -L .venv/share/octokit-openapi ] || rm -rf .venv/share/octokit-openapi  # an older setup's copy
ln -sfn "$octo" .venv/share/octokit-openapi
# `claude` on PATH (/usr/local/bin/claude runs the pinned binary) for your own Claude Code
# (`claude mcp add agentbox …`); a claude you installed yourself is left alone.
sh scripts/claude-wrapper.sh "$cc/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
log "ready: $(.venv/bin/agentbox --version 2>/dev/null || echo agentbox) · claude $ver"
