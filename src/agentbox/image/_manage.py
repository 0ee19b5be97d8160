"""Find, list and remove images: the default one agentbox built, or any local podman image."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agentbox.config import DEFAULT_IMAGE, Settings
from agentbox.errors import ImageError
from agentbox.image import _podman
from agentbox.image._build import DEFAULT_REPO, build_lock, images_dir
from agentbox.image._rootfs import safe_rmtree
from agentbox.image._types import HASH_LABEL, ImageInfo

__all__ = ["list_images", "remove", "resolve"]

_HASH_RE = re.compile(r"[0-9a-f]{16}")


def _rootfs_for(settings: Settings, key: str | None) -> Path | None:
    if key is None or not _HASH_RE.fullmatch(key):
        return None
    d = images_dir(settings) / key
    return d / "rootfs" if (d / "manifest.json").is_file() and (d / "rootfs").is_dir() else None


def resolve(settings: Settings, name: str | None = None) -> ImageInfo:
    """The image a sandbox should run: ``name``, or the configured default when None.

    ``name`` may be any local podman image or the hash of an image agentbox
    built. Nothing is pulled: a missing image raises ImageError saying how to
    get one.
    """
    wanted = name or settings.image
    if _HASH_RE.fullmatch(wanted) and _rootfs_for(settings, wanted) is not None:
        wanted = f"{DEFAULT_REPO}:{wanted}"
    _podman.check_reference(wanted)
    got = _podman.inspect(wanted)
    if got is None:
        if wanted == DEFAULT_IMAGE:
            hint = "run `agentbox image build` to build the default image"
        else:
            hint = "run `agentbox image build` for the default one, or see `podman images`"
        raise ImageError(f"image {wanted} is not in podman's local storage: {hint}")
    key = _podman.labels_of(got).get(HASH_LABEL)
    return ImageInfo(wanted, key, _rootfs_for(settings, key), str(got.get("Id") or "") or None)


def _names(entry: dict[str, Any]) -> list[str]:
    names = entry.get("Names") or []
    return [str(n) for n in names] if isinstance(names, list) else []


def list_images(settings: Settings) -> list[ImageInfo]:
    """Images agentbox built: each in podman (by id) and each kept root without one."""
    out: list[ImageInfo] = []
    seen: set[str] = set()
    ids: set[str] = set()
    for entry in _podman.list_labelled(HASH_LABEL):
        # podman lists an image once per tag; one row per image id.
        if str(entry.get("Id")) in ids:
            continue
        ids.add(str(entry.get("Id")))
        labels = entry.get("Labels") or {}
        key = str(labels.get(HASH_LABEL)) if isinstance(labels, dict) else None
        names = _names(entry)
        name = (
            DEFAULT_IMAGE
            if DEFAULT_IMAGE in names
            else (names[0] if names else str(entry.get("Id")))
        )
        out.append(ImageInfo(name, key, _rootfs_for(settings, key), str(entry.get("Id"))))
        if key:
            seen.add(key)
    d = images_dir(settings)
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if _HASH_RE.fullmatch(p.name) and p.name not in seen:
                rootfs = _rootfs_for(settings, p.name)
                if rootfs is not None:
                    out.append(ImageInfo(f"{DEFAULT_REPO}:{p.name}", p.name, rootfs, None))
    return out


def manifest(info: ImageInfo) -> dict[str, Any] | None:
    """The build manifest next to an image's kept root, if any."""
    if info.rootfs is None:
        return None
    try:
        data = json.loads((info.rootfs.parent / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove(settings: Settings, name_or_hash: str) -> list[str]:
    """Remove an image agentbox built, by name or hash: its podman tags and its kept root.

    Refuses images agentbox did not build (use ``podman rmi`` for those).
    Returns what was removed.
    """
    images = images_dir(settings)
    key: str | None = None
    tags: list[str] = []
    if _HASH_RE.fullmatch(name_or_hash):
        key = name_or_hash
    else:
        got = _podman.inspect(_podman.check_reference(name_or_hash))
        if got is None:
            raise ImageError(
                f"no image {name_or_hash} in podman's storage (see `agentbox image ls`)"
            )
        key = _podman.labels_of(got).get(HASH_LABEL)
        if not key or not _HASH_RE.fullmatch(key):
            raise ImageError(
                f"{name_or_hash} was not built by agentbox; "
                "remove it with `podman rmi` if you mean to"
            )
    for entry in _podman.list_labelled(f"{HASH_LABEL}={key}"):
        tags += _names(entry)
    removed: list[str] = []
    with build_lock(images, lambda _m: None):
        if tags:
            _podman.remove_names(sorted(set(tags)))
            removed += sorted(set(tags))
        d = images / key
        if d.exists():
            safe_rmtree(d)
            removed.append(str(d))
    if not removed:
        raise ImageError(f"no image with hash {key} (see `agentbox image ls`)")
    return removed
