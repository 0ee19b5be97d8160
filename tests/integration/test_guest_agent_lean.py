"""The guest agent's lean start-up: what it replaces, checked against the real thing.

The agent avoids ``json``, ``hmac``/``hashlib``, ``subprocess``, ``socket`` and
``ctypes`` at start-up (each costs a cold boot tens of milliseconds under TCG).
These tests hold its stand-ins to the stdlib modules they replace, and keep the
start-up import set from growing back.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import random
import subprocess
import sys
from hashlib import sha256
from pathlib import Path

import psutil
import pytest

from agentbox.guest import agent
from agentbox.guest.agent import ProtocolError, decode_ctrl, encode_ctrl, proof

AGENT = Path(agent.__file__)
WIRE = AGENT.parent / "wire.py"


def _read_all(fd: int) -> str:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    return out.decode()


@pytest.mark.parametrize("key_len", [0, 1, 32, 63, 64, 65, 200])
def test_proof_is_rfc2104_hmac_sha256(key_len: int) -> None:
    rng = random.Random(key_len)
    for _ in range(20):
        token = "".join(rng.choice("abcdef0123456789é") for _ in range(key_len))
        nonce = "".join(rng.choice("xyz0123456789") for _ in range(rng.randrange(0, 80)))
        want = hmac.new(token.encode(), nonce.encode(), sha256).hexdigest()
        assert proof(token, nonce) == want


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('a"\\\n\t\x00é€😀/') for _ in range(rng.randrange(0, 12)))
    if kind == "int":
        return rng.randrange(-(2**70), 2**70)
    if kind == "float":
        return rng.uniform(-1e300, 1e300)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {str(_random_value(rng, 5)): _random_value(rng, depth + 1) for _ in range(4)}


def test_ctrl_codec_agrees_with_the_json_module() -> None:
    rng = random.Random(7)
    for _ in range(300):
        msg = {"op": "x", "v": _random_value(rng)}
        frame = encode_ctrl(msg)
        payload = frame[agent.HEADER.size :]
        assert json.loads(payload) == msg  # what we write, json reads
        assert decode_ctrl(json.dumps(msg).encode()) == msg  # what json writes, we read


@pytest.mark.parametrize(
    "payload",
    [
        b'{"op": "x"} {"op": "y"}',  # trailing data
        b'{"op": "x", "n": NaN}',
        b'{"op": "x", "n": Infinity}',
        b"[" * 50_000 + b"]" * 50_000,  # nesting deep enough to exhaust recursion
        b'{"op": "\xff"}',
        b"",
        b"   ",
    ],
)
def test_decoder_refuses_what_json_would_not_accept_cleanly(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_ctrl(payload)


@pytest.mark.parametrize("bad", [{"op": "x", "n": float("nan")}, {"op": "x", 1: 2}, {"op": b"x"}])
def test_encoder_refuses_what_is_not_json(bad: dict[object, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        encode_ctrl(bad)


def test_agent_starts_on_builtins_only() -> None:
    # The modules the agent must not import just by starting (the guest's
    # interpreter is the image's; the system python3 stands in for it here).
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import agent; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", "-c", code, str(AGENT.parent)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    heavy = {"json", "re", "subprocess", "socket", "ctypes", "hashlib", "hmac", "enum",
             "threading", "queue", "contextlib", "tarfile", "typing", "signal"}  # fmt: skip
    assert "agent" in out
    assert heavy.isdisjoint(out), sorted(heavy.intersection(out))


def test_spawn_runs_in_a_new_session_with_its_own_cwd_env_and_fds(tmp_path: Path) -> None:
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        pid = agent._spawn(
            ["sh", "-c", 'echo "$FOO $(pwd) $$ $(ps -o sid= -p $$)"; trap - PIPE; kill -0 $$'],
            {"FOO": "bar", "PATH": "/usr/bin:/bin"}, str(tmp_path), None, (null, out_w, out_w),
        )  # fmt: skip
        os.close(out_w)
        text = _read_all(out_r).split()
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(out_r)
        os.close(null)
    assert os.waitstatus_to_exitcode(status) == 0
    assert text[0] == "bar" and text[1] == str(tmp_path)
    assert text[2] == text[3] == str(pid)  # session leader: its own process group


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_spawn_drops_to_the_uid_with_no_groups(tmp_path: Path) -> None:
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    tmp_path.chmod(0o755)
    try:
        pid = agent._spawn(
            ["sh", "-c", "id -u; id -g; id -G; grep -E '^(SigIgn|NoNewPrivs)' /proc/self/status"],
            {"PATH": "/usr/bin:/bin"}, str(tmp_path), 64000, (null, out_w, out_w),
        )  # fmt: skip
        os.close(out_w)
        lines = _read_all(out_r).splitlines()
        os.waitpid(pid, 0)
    finally:
        os.close(out_r)
        os.close(null)
    assert lines[:3] == ["64000", "64000", "64000"]
    sigign = int(lines[3].split()[1], 16)
    assert not sigign & (1 << (agent.SIGPIPE - 1)), "SIGPIPE must be back to its default"


def _zombies() -> set[int]:
    return {c.pid for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE}


def test_spawn_failure_is_an_oserror_with_the_errno(tmp_path: Path) -> None:
    before = _zombies()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            agent._spawn(["no-such-command-xyz"], {"PATH": "/usr/bin"}, str(tmp_path), None,
                         (null, null, null))  # fmt: skip
        assert info.value.errno == errno.ENOENT
        with pytest.raises(OSError) as info:
            agent._spawn(["true"], {"PATH": "/usr/bin:/bin"}, str(tmp_path / "missing"), None,
                         (null, null, null))  # fmt: skip
        assert info.value.errno == errno.ENOENT
    finally:
        os.close(null)
    # the failed child was reaped: no new zombie (other tests' children may exist)
    assert _zombies() <= before


def test_precompiled_agent_is_what_the_guest_imports(tmp_path: Path) -> None:
    from agentbox.backends.microvm._initramfs import AGENT_PARTS, _agent_bytecode

    name, pyc = _agent_bytecode(AGENT.read_bytes())
    assert name == f"agent.{sys.implementation.cache_tag}.pyc"
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / name).write_bytes(pyc)
    # The source the guest sees is never read for an unchecked-hash pyc: prove it by
    # shipping a source that would fail to compile.
    (tmp_path / "agent.py").write_text("this is not python\n")
    # Its sibling wire.py ships the same way (the initramfs carries both).
    wire_name, wire_pyc = _agent_bytecode(WIRE.read_bytes(), "wire")
    assert wire_name == f"wire.{sys.implementation.cache_tag}.pyc"
    (tmp_path / "__pycache__" / wire_name).write_bytes(wire_pyc)
    (tmp_path / "wire.py").write_text("this is not python either\n")
    # And so do the agent's other parts.
    for part in AGENT_PARTS:
        part_name, part_pyc = _agent_bytecode(part.read_bytes(), part.stem)
        (tmp_path / "__pycache__" / part_name).write_bytes(part_pyc)
        (tmp_path / part.name).write_text("not python\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import agent; print(agent.VSOCK_PORT)"
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == str(agent.VSOCK_PORT)
