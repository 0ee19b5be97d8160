"""A ``publish=False`` task's shadow git dir is made readable by the share group
(``_share_shadow``): a pack hard-linked from the base cache is copied first, so the
cache's entry keeps its own group and mode (another task's base must not change with
this one's sharing). Real files, a real chown (root)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agentbox.core.paths import TaskPaths
from agentbox.launcher import _finish

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another group needs root")

GID = 54321  # any group id: chown as root takes it


def test_sharing_a_shadow_changes_no_base_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    cache = data / "cache" / "bases" / "entry"
    cache.mkdir(parents=True, mode=0o700)
    cached = cache / "pack-1.pack"
    cached.write_bytes(b"PACK" + b"\0" * 64)
    cached.chmod(0o444)
    paths = TaskPaths(data, "t1")
    pack_dir = paths.shadow_git / "objects" / "pack"
    pack_dir.mkdir(parents=True)
    os.link(cached, pack_dir / "pack-1.pack")
    (paths.shadow_git / "HEAD").write_text("ref: refs/heads/main\n")
    monkeypatch.setattr(_finish, "share_gid", lambda: GID)

    _finish._share_shadow(paths)

    st = cached.stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode), st.st_nlink) == (0, 0o444, 1)
    shared = (pack_dir / "pack-1.pack").stat()
    assert (shared.st_gid, stat.S_IMODE(shared.st_mode)) == (GID, 0o444)
    assert (pack_dir / "pack-1.pack").read_bytes() == cached.read_bytes()
    assert (paths.shadow_git / "HEAD").stat().st_gid == GID
    assert not list(pack_dir.glob(".*"))  # no copy left beside it
