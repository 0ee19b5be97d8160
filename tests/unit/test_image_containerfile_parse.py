"""Containerfile images without podman: hardening a user's root, the verifier, the key.

The real builds are in tests/integration/test_image_containerfile.py.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from agentbox.errors import ImageError
from agentbox.image import verify
from agentbox.image._cfkey import context_digest
from agentbox.image._containerfile import (
    _checked_tag,
    _user_env,
    containerfile_key,
    from_images,
)
from agentbox.image._harden import harden


def _exe(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _dpkg_list(root: Path, package: str, paths: list[str]) -> None:
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    (info / f"{package}.list").write_text("\n".join(["/.", *paths]) + "\n")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A minimal root that passes verification: merged /usr, the essentials, the agent."""
    r = tmp_path / "root"
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/local/bin", "etc", "tmp", "opt/agentbox"):
        (r / d).mkdir(parents=True)
    for d in ("workspace", "run/agentbox/gw", "home/agent"):
        (r / d).mkdir(parents=True)
    (r / "home/agent").chmod(0o1777)
    (r / "bin").symlink_to("usr/bin")
    (r / "sbin").symlink_to("usr/sbin")
    (r / "lib").symlink_to("usr/lib")
    for name in ("tini", "dash", "bash", "env", "git", "python3", "rg"):
        _exe(r / "usr/bin" / name)
    (r / "usr/bin/sh").symlink_to("dash")
    _exe(r / "usr/local/bin/claude")
    (r / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nagent:x:64000:64000:agent:/home/agent:/bin/bash\n"
    )
    return r


def _packaged_base(root: Path) -> None:
    """What agentbox-base brings: apt/dpkg, packaged setuid tools, a setgid dir not in a list."""
    _exe(root / "usr/bin/apt-get")
    _exe(root / "usr/bin/dpkg")
    _dpkg_list(root, "apt", ["/usr/bin/apt-get"])
    _dpkg_list(root, "dpkg", ["/usr/bin/dpkg"])
    _exe(root / "usr/bin/mount").chmod(0o4755)
    _exe(root / "usr/bin/chage").chmod(0o2755)
    # merged /usr: the list names /bin/mount, the file is /usr/bin/mount
    _dpkg_list(root, "mount", ["/bin/mount"])
    _dpkg_list(root, "passwd", ["/usr/bin/chage"])
    (root / "var/mail").mkdir(parents=True)
    (root / "var/mail").chmod(0o2775)


def test_packaged_setuid_is_stripped_and_the_base_passes(root: Path) -> None:
    _packaged_base(root)
    done = harden(root, strip="packaged")
    assert stat.S_IMODE((root / "usr/bin/mount").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "var/mail").stat().st_mode) == 0o775
    assert {"/usr/bin/mount", "/var/mail"} <= set(done["stripped"])
    assert not (root / "usr/bin/apt-get").exists() and not (root / "usr/bin/dpkg").exists()
    verify(root, tools_anywhere=True)


def test_a_setuid_file_the_containerfile_made_is_refused_by_name(root: Path) -> None:
    _packaged_base(root)
    mine = _exe(root / "usr/local/bin/rootsh")
    mine.chmod(0o4755)
    gid = _exe(root / "opt/tool/helper")
    gid.chmod(0o2755)
    harden(root, strip="packaged")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o4755, "left for the verifier"
    with pytest.raises(ImageError) as err:
        verify(root, tools_anywhere=True)
    text = str(err.value)
    assert "setuid 0o4755: /usr/local/bin/rootsh" in text
    assert "setgid 0o2755: /opt/tool/helper" in text
    # The default image's pass strips everything: the same tree then passes.
    harden(root)
    verify(root, tools_anywhere=True)


def test_a_file_capability_the_containerfile_added_is_refused_by_name(root: Path) -> None:
    ping = _exe(root / "usr/local/bin/myping")
    try:
        # VFS_CAP_REVISION_2 with the effective bit; cap_net_raw (13) permitted
        os.setxattr(
            ping, "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)
        )
    except OSError as exc:
        pytest.skip(f"cannot set a file capability here: {exc}")
    harden(root, strip="packaged")
    with pytest.raises(ImageError, match=r"file capability: /usr/local/bin/myping"):
        verify(root, tools_anywhere=True)


def test_a_package_manager_kept_off_path_is_refused_by_name(root: Path) -> None:
    _packaged_base(root)
    elf = "\x7fELF\x02\x01\x01 (a program)"
    _exe(root / "opt/keep/dpkg", elf)
    _exe(root / "opt/keep/apt-get", elf)
    (root / "usr/share/bash-completion/completions").mkdir(parents=True)
    (root / "usr/share/bash-completion/completions/su").write_text("# not a program\n")
    # build-essential brings dpkg-dev's reportbug hook: a script, not a package manager
    _exe(root / "usr/share/bug/dpkg-dev", "#!/bin/sh\necho hook\n")
    harden(root, strip="packaged")
    verify(root)  # the default image's check looks on PATH only
    with pytest.raises(ImageError) as err:
        verify(root, tools_anywhere=True)
    text = str(err.value)
    assert "forbidden tool: /opt/keep/dpkg" in text and "forbidden tool: /opt/keep/apt-get" in text
    assert "completions/su" not in text and "/usr/share/bug/dpkg-dev" not in text


def test_from_images() -> None:
    text = """# syntax
ARG X=1
FROM --platform=linux/amd64 localhost/agentbox-base:latest AS build
RUN true
from build
FROM scratch
FROM localhost/other:1 as final
COPY --from=build /a /b
FROM localhost/agentbox-base:latest
"""
    assert from_images(text) == ["localhost/agentbox-base:latest", "localhost/other:1"]


def test_key_follows_containerfile_context_and_base(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "sub/a.txt").write_text("a\n")
    (ctx / "link").symlink_to("sub/a.txt")

    def key(text: bytes = b"FROM x\n", base: str = "id1") -> str:
        return containerfile_key(
            text,
            ctx,
            {"x": base},
            claude_version="1",
            claude_digest="d",
            guest={"relay.py": "h"},
            sandbox_uid=64000,
        )

    first = key()
    assert key() == first
    assert key(b"FROM x\nRUN true\n") != first
    assert key(base="id2") != first
    before = context_digest(ctx)
    (ctx / "sub/a.txt").write_text("b\n")
    assert context_digest(ctx) != before and key() != first
    (ctx / "sub/a.txt").write_text("a\n")
    assert key() == first
    (ctx / "sub/a.txt").chmod(0o600)
    assert key() != first


def test_tag_may_not_take_agentbox_names() -> None:
    assert _checked_tag("localhost/mine:dev") == "localhost/mine:dev"
    assert _checked_tag(None) is None
    for bad in (
        "localhost/agentbox-default:latest",
        "agentbox-base",
        "localhost/agentbox-custom:x",
    ):
        with pytest.raises(ImageError, match="belongs to an image agentbox makes"):
            _checked_tag(bad)
    with pytest.raises(ImageError, match="not a valid image name"):
        _checked_tag("--rm")


def test_user_env_keeps_theirs_and_replaces_ours() -> None:
    info = {"Config": {"Env": ["PATH=/x", "NODE_ENV=production", "A=two words", "bad name=1"]}}
    assert _user_env(info) == ['ENV NODE_ENV="production"', 'ENV A="two words"']
    assert _user_env({}) == []


def test_boxfile_image_table_paths_are_relative_to_the_boxfile(tmp_path: Path) -> None:
    from agentbox.boxfile import Boxfile, loads_boxfile

    where = tmp_path / "repo/.agentbox/Boxfile.toml"
    box = loads_boxfile(
        '[image]\ncontainerfile = "../ci/Containerfile"\n'
        'context = "../ci"\ntag = "localhost/p:1"\n',
        path=where,
    )
    assert box.image_build is not None
    assert box.image_build.containerfile == where.parent / "../ci/Containerfile"
    assert box.image_build.context == where.parent / "../ci"
    assert box.image_build.tag == "localhost/p:1"
    # The CLI's round trip (dump, then validate again) keeps it.
    again = Boxfile.from_dict(box.model_dump(exclude_unset=True, mode="json"), path=where)
    assert again.image_build == box.image_build


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[image]\ncontainerfile = "x"\nfoo = 1\n', "image.foo"),
        ("[image]\n", "image.containerfile"),
        ('[image]\ncontainerfile = "x"\ntag = "--rm"\n', "image.tag"),
        ("image = 3\n", "image"),
    ],
)
def test_boxfile_image_table_refusals_name_the_key(text: str, key: str) -> None:
    from agentbox.boxfile import loads_boxfile
    from agentbox.errors import BoxfileError

    with pytest.raises(BoxfileError) as err:
        loads_boxfile(text, path=Path("/b.toml"))
    assert err.value.key == key


def test_an_unbuilt_image_table_never_makes_a_sandbox(tmp_path: Path) -> None:
    # The launcher (and a committed Boxfile) never starts a build: only the CLI does.
    from agentbox.boxfile import loads_boxfile
    from agentbox.config import Settings
    from agentbox.errors import ConfigError
    from agentbox.sandbox import spec_from_boxfile

    box = loads_boxfile('[image]\ncontainerfile = "Containerfile"\n', path=tmp_path / "B.toml")
    with pytest.raises(ConfigError, match=r"\[image\] table .* never by the launcher"):
        spec_from_boxfile(box, Settings(data_dir=tmp_path / "data"))
    built = box.model_copy(update={"image": "localhost/built:1", "image_build": None})
    assert (
        spec_from_boxfile(built, Settings(data_dir=tmp_path / "data")).image == "localhost/built:1"
    )


def test_a_default_build_prunes_old_defaults_but_never_containerfile_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from agentbox.image import _build, _podman

    images = tmp_path / "images"
    made = {}
    for i, kind in enumerate(["default", "default", "default", "containerfile", "default"]):
        key = f"{i:016x}"
        d = images / key
        (d / "rootfs").mkdir(parents=True)
        manifest = {"hash": key} if kind == "default" else {"hash": key, "kind": kind}
        (d / "manifest.json").write_text(json.dumps(manifest))
        os.utime(d, (1000 + i, 1000 + i))
        made[key] = kind
    # podman holds none of them (the podman half of pruning is tested with real podman)
    monkeypatch.setattr(_podman, "list_labelled", lambda _label: [])
    newest = f"{4:016x}"
    removed = _build._prune(images, newest, "base")
    left = {p.name for p in images.iterdir()}
    # the new one and the 2 newest older defaults stay; the Containerfile image stays
    assert left == {newest, f"{2:016x}", f"{1:016x}", f"{3:016x}"}
    assert removed == [str(images / f"{0:016x}")]
