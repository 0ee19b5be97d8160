#!/bin/bash
# bench/snapshot.sh NAME [COMMIT] [FILE...]: a frozen copy of the tree to bench from.
#
# The front end declines to serve when the checkout changes under it (its stale-code
# check), and /work/main is shared, so a bench run from it can fail or measure someone
# else's half-written change. This copies src/, bench/ and demo/ at COMMIT (default
# HEAD) into /tmp/absnap-NAME, then FILE... (paths relative to the checkout) as they
# are in the working tree, and gives the copy its own venv (the checkout's packages,
# this copy's src first) with an `agentbox` launcher script. Prints the directory.
#
#   bench/snapshot.sh before HEAD
#   bench/snapshot.sh after HEAD src/agentbox/collect/_prepare.py
#   (cd /tmp/absnap-after && venv/bin/python bench/task_overhead.py --served --runs 4)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
name=$1; shift
commit=${1:-HEAD}; [ $# -gt 0 ] && shift
case $name in ''|*/*|.*) echo "bad name $name" >&2; exit 2;; esac
snap=/tmp/absnap-$name
rm -rf "$snap"; mkdir -p "$snap"
git -C "$here" archive "$commit" src bench demo | tar -x -C "$snap"
for f in "$@"; do mkdir -p "$snap/$(dirname "$f")"; cp -p "$here/$f" "$snap/$f"; done
py=$("$here/.venv/bin/python" -c 'import sys; print(sys._base_executable)')
"$py" -m venv --without-pip "$snap/venv"
site=$("$here/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$py" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
printf '%s\n' "$snap/src" "$site" > "$snap/venv/lib/$ver/site-packages/snap.pth"
printf '#!%s\nimport sys\nfrom agentbox.front.client import entry\nsys.exit(entry())\n' \
    "$snap/venv/bin/python3" > "$snap/venv/bin/agentbox"
chmod +x "$snap/venv/bin/agentbox"
echo "$snap"
