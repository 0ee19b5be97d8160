"""The private servers the credential-brokering tests stand on: each asks for its credential."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from private_servers import (
    GIT_HOST,
    NPM_HOST,
    NPM_PACKAGE,
    PYPI_HOST,
    WHEEL_NAME,
    in_netns,
    missing,
    private_servers,
    reap_stale_netns,
)

pytestmark = pytest.mark.skipif(bool(missing()), reason=f"needs {', '.join(missing())}")


def test_servers_refuse_without_and_serve_with_the_credential(tmp_path: Path) -> None:
    with private_servers(tmp_path / "srv") as srv:
        assert srv.get(PYPI_HOST, f"/simple/{WHEEL_NAME}/")[0] == 401
        status, body = srv.get(PYPI_HOST, f"/simple/{WHEEL_NAME}/", auth=srv.basic)
        assert status == 200 and b"corp_util-1.0-py3-none-any.whl" in body
        assert srv.get(GIT_HOST, "/proj.git/info/refs?service=git-upload-pack")[0] == 401
        status, body = srv.get(
            GIT_HOST, "/proj.git/info/refs?service=git-upload-pack", auth=srv.basic
        )
        assert status == 200 and b"refs/heads/main" in body
        assert srv.get(NPM_HOST, "/@corp%2fgreet")[0] in (401, 403)
        status, body = srv.get(NPM_HOST, "/@corp%2fgreet", auth=f"Bearer {srv.npm_token}")
        assert status == 200
        doc = json.loads(body)
        assert doc["name"] == NPM_PACKAGE
        assert doc["versions"]["1.0.0"]["dist"]["tarball"].startswith(f"https://{NPM_HOST}/")
    # Nothing is left: the namespace is gone.
    assert (
        srv.netns
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    assert all(p.poll() is not None for p in srv.procs)


def test_a_dead_runs_namespace_is_reaped_and_a_live_ones_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag_dead, tag_live = "d0d0d0", "a1a1a1"
    ns_dead, ns_live = f"abpriv-{dead.pid}-{tag_dead}", f"abpriv-{os.getpid()}-{tag_live}"
    made: list[str] = []
    try:
        for ns, tag in ((ns_dead, tag_dead), (ns_live, tag_live)):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            made.append(ns)
            subprocess.run(["ip", "link", "add", f"abp{tag}h", "type", "veth", "peer", "name",
                            f"abp{tag}n", "netns", ns], check=True)  # fmt: skip
        # A server the dead run left in its namespace.
        left = subprocess.Popen([*in_netns(ns_dead), "sleep", "600"], start_new_session=True)
        try:
            reaped = reap_stale_netns()
            assert ns_dead in reaped and ns_live not in reaped
            assert left.wait(timeout=30) != 0  # killed with its namespace
        finally:
            if left.poll() is None:
                left.kill()
                left.wait()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert ns_dead not in names and ns_live in names
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"abp{tag_dead}h" not in links and f"abp{tag_live}h" in links
    finally:
        for ns, tag in ((ns_dead, tag_dead), (ns_live, tag_live)):
            subprocess.run(["ip", "link", "del", f"abp{tag}h"], capture_output=True)
            if ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
