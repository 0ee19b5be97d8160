"""``python -m agentbox.egress``: one task's egress proxy (started by :func:`spawn_proxy`).

The policy is read as JSON from standard input; argv carries only paths and numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentbox.errors import AgentboxError, ConfigError


def _user(spec: str) -> tuple[int, int]:
    uid, _, gid = spec.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ConfigError(f"--user {spec!r}: use numeric UID or UID:GID")
    return int(uid), int(gid or uid)


def main(argv: list[str] | None = None) -> int:
    """Parse argv, read the policy from stdin, serve until SIGTERM."""
    from agentbox.egress._process import read_policy, read_secrets, run_proxy

    p = argparse.ArgumentParser(prog="python -m agentbox.egress", description=__doc__)
    p.add_argument("--socket", type=Path, required=True, help="unix socket to listen on")
    p.add_argument("--log", type=Path, required=True, help="egress log (JSON lines)")
    p.add_argument("--user", help="drop to UID[:GID] once listening (start as root)")
    p.add_argument("--ready-fd", type=int, help="write 'ready' to this fd once serving")
    p.add_argument("--max-memory", type=int, default=512 << 20, help="RLIMIT_AS; 0: none")
    p.add_argument("--secrets-fd", type=int, help="read the rules' secret values (JSON) here")
    p.add_argument("--ca-out", type=Path, help="write the task CA's certificate here")
    args = p.parse_args(argv)
    try:
        policy = read_policy(sys.stdin.buffer)
        values = read_secrets(args.secrets_fd) if args.secrets_fd is not None else {}
        run_proxy(
            socket_path=args.socket.absolute(),
            policy=policy,
            log_path=args.log,
            run_as=_user(args.user) if args.user else None,
            ready_fd=args.ready_fd,
            max_memory=args.max_memory or None,
            secret_values=values,
            ca_out=args.ca_out,
        )
    except AgentboxError as exc:
        print(f"agentbox egress: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
