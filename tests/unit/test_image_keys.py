"""Content keys of the image layers and the host apt sources they hash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import agentbox.image as image
from agentbox.errors import ImageError
from agentbox.image import _keys


def test_public_surface() -> None:
    assert sorted(image.__all__) == [
        "BASE_IMAGE",
        "CUSTOM_REPO",
        "HASH_LABEL",
        "ImageInfo",
        "SUITE",
        "build_containerfile",
        "build_default",
        "build_for_boxfile",
        "host_apt_sources",
        "images_dir",
        "list_images",
        "manifest",
        "remove",
        "resolve",
        "verify",
    ]
    info = image.ImageInfo("x", None, None, None)
    assert info.cached is False
    with pytest.raises(AttributeError):
        info.name = "y"  # type: ignore[misc]


def _apt_dir(tmp_path: Path) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n"
        "# a comment that must not matter\n"
        "URIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates trixie\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        "\n"
        "Types: deb\n"
        "URIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "URIs: https://thirdparty.invalid/node\n"
        "Suites: nodistro\n"
        "Components: main\n"
        "\n"
        "Types: deb-src\n"
        "URIs: http://mirror.invalid/debian\n"
        "Suites: bookworm\n"
        "Components: main\n"
    )
    (apt / "sources.list.d" / "other.list").write_text(
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.invalid/x bookworm main\n"
        "deb http://thirdparty.invalid/cloud cloud-sdk-bookworm main\n"
        "# deb http://mirror.invalid/y bookworm main\n"
    )
    (apt / "sources.list.d" / "off.list.disabled").write_text(
        "deb http://mirror.invalid/z bookworm main\n"
    )
    return apt


def test_host_sources_keep_only_the_suite(tmp_path: Path) -> None:
    src = _keys.host_apt_sources("bookworm", _apt_dir(tmp_path))
    assert "bookworm bookworm-updates" in src.deb822 and "trixie" not in src.deb822
    assert "bookworm-security" in src.deb822
    assert "thirdparty" not in src.deb822 + src.one_line
    assert "deb-src" not in src.deb822 and "comment" not in src.deb822
    assert src.one_line.splitlines() == [
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.invalid/x bookworm main"
    ]
    assert "/z" not in src.content
    assert [p.name for p in src.origin] == ["debian.sources", "other.list"]


def test_host_sources_missing_suite_is_an_error(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    apt.mkdir()
    (apt / "sources.list").write_text("deb http://mirror.invalid/debian trixie main\n")
    with pytest.raises(ImageError, match="no apt source for Debian bookworm"):
        _keys.host_apt_sources("bookworm", apt)


def test_base_key_follows_sources_and_packages(tmp_path: Path) -> None:
    src = _keys.host_apt_sources("bookworm", _apt_dir(tmp_path))
    k = _keys.base_key(src)
    assert k == _keys.base_key(src) and len(k) == 16
    assert _keys.base_key(src, packages=[*_keys.PACKAGES, "jq"]) != k
    assert _keys.base_key(src, packages=list(reversed(_keys.PACKAGES))) == k
    other = _keys.AptSources(
        src.one_line + "deb http://m.invalid/d bookworm contrib\n", src.deb822, ()
    )
    assert _keys.base_key(other) != k


def test_guest_change_moves_final_key_not_base_key(tmp_path: Path) -> None:
    apt = _apt_dir(tmp_path)
    guest = tmp_path / "guest"
    guest.mkdir()
    (guest / "relay.py").write_text("#!/usr/bin/python3\nprint('relay')\n")
    (guest / "agent.py").write_text("print('agent')\n")
    (guest / "notes.txt").write_text("not a program")

    def keys() -> tuple[str, str]:
        base = _keys.base_key(_keys.host_apt_sources("bookworm", apt))
        final = _keys.final_key(
            base,
            claude_version="2.1.332",
            claude_digest="d" * 64,
            guest=_keys.guest_files(guest),
            sandbox_uid=64000,
        )
        return base, final

    base1, final1 = keys()
    assert set(_keys.guest_files(guest)) == {"relay.py", "agent.py"}
    (guest / "relay.py").write_text("#!/usr/bin/python3\nprint('relay v2')\n")
    base2, final2 = keys()
    assert base2 == base1 and final2 != final1
    (guest / "probe.py").write_text("print('probe')\n")
    assert keys()[1] not in (final1, final2)
    # The non-guest inputs move it too.
    f = _keys.final_key(
        base1, claude_version="2.1.333", claude_digest="d" * 64, guest={}, sandbox_uid=64000
    )
    g = _keys.final_key(
        base1, claude_version="2.1.332", claude_digest="d" * 64, guest={}, sandbox_uid=64000
    )
    h = _keys.final_key(
        base1, claude_version="2.1.332", claude_digest="e" * 64, guest={}, sandbox_uid=64000
    )
    assert len({f, g, h}) == 3


def test_file_digest_is_remembered_by_stat(tmp_path: Path) -> None:
    blob = tmp_path / "claude"
    blob.write_bytes(b"one")
    memo = tmp_path / "digests.json"
    d1 = _keys.file_digest(blob, memo)
    assert memo.is_file() and d1 == _keys.file_digest(blob)
    # A remembered digest is used while size, mtime and inode are unchanged...
    memo.write_text(memo.read_text().replace(d1, "f" * 64))
    assert _keys.file_digest(blob, memo) == "f" * 64
    # ...and recomputed once the file changes.
    blob.write_bytes(b"two")
    os.utime(blob, ns=(1, 1))
    assert _keys.file_digest(blob, memo) == _keys.file_digest(blob) != d1
    with pytest.raises(ImageError, match="cannot read"):
        _keys.file_digest(tmp_path / "missing")
