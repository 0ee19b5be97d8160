"""The private servers the credential-brokering tests stand on: each asks for its credential."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from private_servers import (
    GIT_HOST,
    NPM_HOST,
    NPM_PACKAGE,
    PYPI_HOST,
    WHEEL_NAME,
    missing,
    private_servers,
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
