"""The cluster's secrets and the node proof (issue 33 §1), without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.cluster import _secure
from agentbox.errors import RefusedError


def test_missing_or_readable_secrets_are_refused_naming_the_fix(tmp_path: Path) -> None:
    where = tmp_path / "cluster"
    with pytest.raises(RefusedError, match=r"no ray-token at .*agentbox node keygen"):
        _secure.load_secrets(where)
    _secure.keygen(where)
    sec = _secure.load_secrets(where)
    assert len(sec.token) == 64 and len(sec.key) == 64
    assert where.stat().st_mode & 0o777 == 0o700
    (where / "ray-token").chmod(0o644)  # readable by every local user: refused
    with pytest.raises(RefusedError, match=r"mode 0600 .*chmod 600"):
        _secure.load_secrets(where)
    env = _secure.ray_env(sec)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == sec.token


def test_only_a_holder_of_the_cluster_key_proves_a_node() -> None:
    key = b"k" * 32
    nkey = _secure.node_key(key, "n1")
    good = _secure.proof(nkey, "nonce", "id1", "n1")
    assert _secure.check_proof(key, "nonce", "id1", "n1", good)
    # Control-like negatives: another cluster key, another nonce (a replay), another
    # node id or name (a proof moved to another node), a made-up answer.
    assert not _secure.check_proof(b"x" * 32, "nonce", "id1", "n1", good)
    assert not _secure.check_proof(key, "nonce2", "id1", "n1", good)
    assert not _secure.check_proof(key, "nonce", "id2", "n1", good)
    assert not _secure.check_proof(key, "nonce", "id1", "n2", good)
    assert not _secure.check_proof(key, "nonce", "id1", "n1", "0" * 64)
    assert not _secure.check_proof(key, "nonce", "id1", "n1", None)
    # A node's key is not the cluster key, and differs per node.
    assert nkey != key and nkey != _secure.node_key(key, "n2")


def test_the_node_actor_refuses_to_run_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Ray worker of a node runs as agentbox-node; an actor started as root (a
    cluster started the old way) refuses before it touches anything. The process is made
    to look like root: the test itself needs no privileges."""
    import os

    pytest.importorskip("ray", reason="the agentbox[ray] extra is not installed")
    from agentbox.cluster._ray import NodeActor

    monkeypatch.setattr(os, "geteuid", lambda: 0)

    with pytest.raises(RefusedError, match=r"runs as root: start the node with `agentbox node"):
        NodeActor({}, 1, "n", "/nonexistent", "/nonexistent", "/nonexistent")
