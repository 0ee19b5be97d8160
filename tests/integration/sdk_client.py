"""The SDK as a user drives it (tests/integration/test_sdk.py runs it as another uid).

Usage: python sdk_client.py MODE [ARG]; prints one JSON object (the facts seen) on its
last stdout line. Modes: sync, async, hold, other SANDBOX_ID, task REPO.
Not a test module: the test runs it as a non-root member of the group agentbox, with
the world-readable interpreter setup installs (/opt/agentbox/venv).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentbox import AsyncSandbox, Client, Sandbox
from agentbox.errors import AgentboxError, PathRefused, SandboxGone

# Prints "a", then waits (at most 120 s) until the client wrote /tmp/go, then prints "b":
# only a client that received "a" while the command still ran can let it finish.
HANDSHAKE = (
    "echo a; i=0; while [ ! -e /tmp/go ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; echo b"
)


def wait_for_spare() -> None:
    """Until the launcher's warm spare waits (at most 120 s; it starts with the launcher)."""
    from agentbox.sdk._transport import connect

    with connect() as c:
        for _ in range(600):
            if c.sandbox_listing().spare_ready:
                return
            time.sleep(0.2)


def sync_mode() -> dict[str, Any]:
    out: dict[str, Any] = {"uid": os.getuid()}
    work = Path(tempfile.mkdtemp(prefix="sdk-"))
    wait_for_spare()
    with Sandbox.create(timeout=600) as sb:
        out["id"] = sb.id
        out["warm"] = sb.info.warm  # its first command: the exec started ahead (podman)
        r = sb.commands.run("python3 -c 'print(6*7)'; echo oops >&2; exit 3")
        out["run"] = [r.exit_code, r.stdout, r.stderr]
        out["argv"] = sb.commands.run(["printf", "%s|", "a b", "c"]).stdout
        chunks, released = [], False
        stream = sb.commands.run(HANDSHAKE, stream=True)
        for c in stream:
            chunks.append(c.data)
            if "a" in c.data and not released:
                sb.files.write("/tmp/go", "")  # while the command still runs
                released = True
        out["stream"] = ["".join(chunks), stream.result.exit_code if stream.result else None]
        h = sb.commands.run("sleep 300 & sleep 300; echo never", background=True)
        h.kill()
        done = h.wait(timeout=120)
        out["killed"] = [done.exit_code, "never" in done.stdout]
        out["sleeps_left"] = sb.commands.run(
            "ps -eo args | grep -c '^sleep 300' || true"
        ).stdout.strip()
        # files: write, read, list; a tree up and down again
        sb.files.write("/workspace/d/a.py", "print(1)\n")
        out["read"] = sb.files.read("/workspace/d/a.py")
        out["list"] = [(e.name, e.type, e.size) for e in sb.files.list("/workspace/d")]
        src = work / "src"
        (src / "pkg").mkdir(parents=True)
        (src / "pkg" / "m.py").write_text("X = 1\n")
        (src / "top.txt").write_bytes(bytes(range(256)))
        sb.upload(src, "/workspace/tree")
        got = sb.download("/workspace/tree", work / "back")
        out["roundtrip"] = [
            (got / "pkg" / "m.py").read_text(),
            (got / "top.txt").read_bytes() == bytes(range(256)),
        ]
        # links planted by the sandbox: none is followed here
        sb.commands.run(
            "mkdir -p /workspace/evil && cd /workspace/evil && echo fine > f && "
            "ln -s /etc/passwd abs && ln -s ../../../../../../../etc/passwd rel && "
            "ln -s / root && ln -s f inside"
        )
        got = sb.download("/workspace/evil", work / "evil")
        seen = {}
        for p in sorted(got.iterdir()):
            seen[p.name] = "link" if p.is_symlink() else "file" if p.is_file() else "other"
        out["evil"] = seen
        out["evil_inside_target"] = (
            os.readlink(got / "inside") if (got / "inside").is_symlink() else None
        )
        passwd = Path("/etc/passwd").read_bytes()
        out["evil_leaked"] = any(
            p.is_file() and not p.is_symlink() and p.read_bytes() == passwd for p in got.rglob("*")
        )
        # a link already in the way on this host is not followed either
        victim = work / "victim"
        victim.mkdir()
        (work / "trap").mkdir()
        (work / "trap" / "evil").symlink_to(victim)
        try:
            sb.download("/workspace/evil", work / "trap")
            out["trap"] = "followed"
        except PathRefused as exc:
            out["trap"] = f"refused: {type(exc).__name__}"
        out["victim"] = sorted(p.name for p in victim.iterdir())
        out["listed"] = sb.id in [i.id for i in Sandbox.list()]
    out["gone_after_with"] = sb.id not in [i.id for i in Sandbox.list()]
    return out


async def async_body() -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with await AsyncSandbox.create(timeout=600) as sb:
        r = await sb.commands.run("echo hi; exit 4")
        out["run"] = [r.exit_code, r.stdout]
        chunks, released = [], False
        stream = await sb.commands.run(HANDSHAKE, stream=True)
        async for c in stream:
            chunks.append(c.data)
            if "a" in c.data and not released:
                await sb.files.write("/tmp/go", "")
                released = True
        out["stream"] = ["".join(chunks), stream.result.exit_code if stream.result else None]
        h = await sb.commands.run("sleep 300", background=True)
        await h.kill()
        out["killed"] = (await h.wait(timeout=120)).exit_code
        await sb.files.write("/workspace/x.txt", "async\n")
        out["read"] = await sb.files.read("/workspace/x.txt")
        out["list"] = [e.name for e in await sb.files.list("/workspace")]
        work = Path(tempfile.mkdtemp(prefix="sdk-"))
        got = await sb.download("/workspace/x.txt", work)
        out["download"] = got.read_text()
        out["id"] = sb.id
        # fork: two copies of its files now (workspace and tmpfs), each its own sandbox
        await sb.files.write("/tmp/t.txt", "tmpfs\n")
        forks = await sb.fork(2, timeout=300)
        try:
            f1, f2 = forks
            out["fork_ids"] = len({sb.id, f1.id, f2.id})
            out["fork_uids"] = [f.info.uid for f in forks]
            out["fork_deadlines"] = [round(f.info.deadline_at - time.time()) for f in forks]
            out["fork_parent_deadline"] = round(sb.info.deadline_at - time.time())
            out["fork_seen"] = [[await f.files.read("/workspace/x.txt"),
                                 await f.files.read("/tmp/t.txt")] for f in forks]  # fmt: skip
            # the fork's files are its own uid's: it appends to one and makes new ones
            r = await f1.commands.run("echo one >> /workspace/x.txt && echo 1 > /workspace/only1")
            out["fork_write"] = r.exit_code
            out["fork_after"] = {
                "f1": await f1.files.read("/workspace/x.txt"),
                "f2": await f2.files.read("/workspace/x.txt"),
                "parent": await sb.files.read("/workspace/x.txt"),
                "f2_only1": (await f2.commands.run("test -e /workspace/only1")).exit_code,
                "parent_only1": (await sb.commands.run("test -e /workspace/only1")).exit_code,
            }
            out["fork_listed"] = sorted(i.id for i in await AsyncSandbox.list()) == sorted(
                [sb.id, f1.id, f2.id]
            )
        finally:
            for f in forks:
                await f.close()
        out["forks_gone"] = not {f.id for f in forks} & {i.id for i in await AsyncSandbox.list()}
    out["gone_after_with"] = out["id"] not in [i.id for i in await AsyncSandbox.list()]
    return out


def hold_mode() -> None:
    """Create a sandbox, say its id, then wait for stdin to close (or to be killed)."""
    sb = Sandbox.create(timeout=600)
    host = sb.commands.run("hostname").stdout.strip()  # podman: the container id's prefix
    print(json.dumps({"id": sb.id, "container": host}), flush=True)
    sys.stdin.read()


def other_mode(sid: str) -> dict[str, Any]:
    out: dict[str, Any] = {"listed": sid in [i.id for i in Sandbox.list()]}
    for what, fn in (("connect", lambda: Sandbox.connect(sid)),):
        try:
            fn()
            out[what] = "reached"
        except SandboxGone:
            out[what] = "gone"
    # the transport itself, call by call: every one answers as for an unknown id
    from agentbox.launcher.boxapi import ExecRequest
    from agentbox.sdk._transport import connect

    with connect() as c:
        calls = {
            "get": lambda: c.sandbox_get(sid),
            "exec": lambda: list(c.sandbox_exec(sid, ExecRequest(cmd="id"))),
            "read": lambda: c.sandbox_read(sid, "/etc/hostname"),
            "write": lambda: c.sandbox_write(sid, "/tmp/x", b"x"),
            "download": lambda: c.sandbox_download(sid, "/workspace"),
            "remove": lambda: c.sandbox_remove(sid),
        }
        for name, call in calls.items():
            try:
                call()
                out[name] = "reached"
            except SandboxGone:
                out[name] = "gone"
            except AgentboxError as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    return out


def connect_mode(sid: str) -> dict[str, Any]:
    """The owner, from another process: re-attach, run, leave (the sandbox stays)."""
    with Sandbox.connect(sid) as sb:
        r = sb.commands.run("echo $((6*7))")
        holders = sb.refresh().holders
    return {"out": r.stdout, "holders": holders,
            "alive_after_with": sid in [i.id for i in Sandbox.list()]}  # fmt: skip


def task_mode(repo: str) -> dict[str, Any]:
    with Client() as c:
        t = c.tasks.create(repo=repo, prompt="Write greet.py", model="quick")
        kinds = [e.kind for e in t.events()]
        res = t.wait(timeout=900)
        listed = [x.id for x in c.tasks.list()]
        again = c.tasks.get(t.id)
        # a task kept unpublished, then published from Python
        kept = c.tasks.create(repo=repo, prompt="Write greet.py", model="quick", publish=False)
        kept_res = kept.wait(timeout=900)
        published = kept.publish()
    return {
        "status": res.status,
        "branch": res.branch,
        "diff_has_greet": "greet.py" in res.diff,
        "cost_usd": res.cost_usd,
        "events": len(kinds),
        "listed": t.id in listed,
        "get": again.status,
        "kept_branch": kept_res.branch,
        "published_branch": published.branch,
        "published_id": kept.id,
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "hold":
        hold_mode()
        return
    if mode == "sync":
        out = sync_mode()
    elif mode == "async":
        out = asyncio.run(async_body())
    elif mode == "other":
        out = other_mode(sys.argv[2])
    elif mode == "connect":
        out = connect_mode(sys.argv[2])
    elif mode == "task":
        out = task_mode(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
