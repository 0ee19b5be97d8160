"""Find, list and remove images: the default one agentbox built, or any local podman image.

Which images agentbox built: an image carrying the hash label
(``io.agentbox.image.hash``) **and no parent image**. agentbox makes its
images with ``podman import`` (one layer, no parent); an image a user builds
``FROM`` one of them inherits every label, the hash included, but podman
records its parent. So a derived image is never listed, never removed by
``agentbox image rm``, never given the base's kept root (a microVM would run
the base, not it), and an image that is the base of another is never removed.
"""

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

_HASH_RE = re.compile(r"[0-9a-f]{16}")


def _rootfs_for(settings: Settings, key: str | None) -> Path | None:
    if key is None or not _HASH_RE.fullmatch(key):
        return None
    d = images_dir(settings) / key
    return d / "rootfs" if (d / "manifest.json").is_file() and (d / "rootfs").is_dir() else None


def _own_key(labels: dict[str, str], parent: object) -> str | None:
    """The content hash of an image agentbox built; None for any other (derived, foreign)."""
    key = labels.get(HASH_LABEL)
    if not key or not _HASH_RE.fullmatch(key) or parent:
        return None
    return key


def _entry_key(entry: dict[str, Any]) -> str | None:
    labels = entry.get("Labels")
    if not isinstance(labels, dict):
        return None
    return _own_key({str(k): str(v) for k, v in labels.items()}, entry.get("ParentId"))


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
    # A derived image inherits the hash label: it is not the image built, and the
    # kept root is not its root (hash and root stay None).
    key = _own_key(_podman.labels_of(got), got.get("Parent"))
    return ImageInfo(wanted, key, _rootfs_for(settings, key), str(got.get("Id") or "") or None)


def _names(entry: dict[str, Any]) -> list[str]:
    names = entry.get("Names") or []
    return [str(n) for n in names] if isinstance(names, list) else []


def _display_name(names: list[str], key: str, image_id: str) -> str:
    """``…:latest`` if the image has it, else a name the user gave it (``--tag``), else
    its ``<repo>:<hash>`` tag, else any name."""
    if DEFAULT_IMAGE in names:
        return DEFAULT_IMAGE
    tagged = [n for n in names if n.endswith(f":{key}")]
    given = sorted(n for n in names if n not in tagged)
    return (given or tagged or [image_id])[0]


def list_images(settings: Settings) -> list[ImageInfo]:
    """Images agentbox built: each in podman (by id) and each kept root without one.

    Images derived from one (``FROM localhost/agentbox-default``) carry its
    hash label too; they are not listed: agentbox did not build them.
    """
    out: list[ImageInfo] = []
    seen: set[str] = set()
    ids: set[str] = set()
    for entry in _podman.list_labelled(HASH_LABEL):
        # podman lists an image once per tag; one row per image id.
        image_id = str(entry.get("Id"))
        key = _entry_key(entry)
        if image_id in ids or key is None:
            continue
        ids.add(image_id)
        name = _display_name(_names(entry), key, image_id)
        out.append(ImageInfo(name, key, _rootfs_for(settings, key), image_id))
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


def _children(images: list[dict[str, Any]], ids: set[str]) -> list[str]:
    """Names (or ids) of the images whose parent is one of ``ids``."""
    out: set[str] = set()
    for entry in images:
        if str(entry.get("ParentId") or "") in ids and str(entry.get("Id")) not in ids:
            out.add(next(iter(sorted(_names(entry))), str(entry.get("Id"))[:12]))
    return sorted(out)


def remove(settings: Settings, name_or_hash: str) -> list[str]:
    """Remove one image agentbox built, by name or hash: its podman tags and its kept root.

    Removes exactly that image: refuses images agentbox did not build (a
    foreign one, or one built ``FROM`` an agentbox image, which inherits the
    hash label: use ``podman rmi`` for those), and refuses an image that is
    the base of another image (remove that one first). Returns what was removed.
    """
    images = images_dir(settings)
    labelled = _podman.list_labelled(HASH_LABEL)
    if _HASH_RE.fullmatch(name_or_hash):
        key = name_or_hash
        ids = {str(e.get("Id")) for e in labelled if _entry_key(e) == key}
    else:
        got = _podman.inspect(_podman.check_reference(name_or_hash))
        if got is None:
            raise ImageError(
                f"no image {name_or_hash} in podman's storage (see `agentbox image ls`)"
            )
        labels = _podman.labels_of(got)
        own = _own_key(labels, got.get("Parent"))
        if own is None:
            derived = (
                f" (it is derived from image {str(got.get('Parent'))[:12]} and inherits its label)"
                if labels.get(HASH_LABEL) and got.get("Parent")
                else ""
            )
            raise ImageError(
                f"{name_or_hash} was not built by agentbox{derived}; "
                "remove it with `podman rmi` if you mean to"
            )
        key = own
        ids = {str(got.get("Id"))}
    children = _children(labelled, ids)
    if children:
        raise ImageError(
            f"{name_or_hash} is the base of {', '.join(children[:5])}: "
            "remove those first (`podman rmi`); nothing was removed"
        )
    tags = sorted({n for e in labelled if str(e.get("Id")) in ids for n in _names(e)})
    removed: list[str] = []
    with build_lock(images, lambda _m: None):
        if tags or ids:
            # By name, so podman deletes each image with its last tag; an image
            # with no name at all is removed by its id.
            targets = tags or sorted(ids)
            _podman.remove_names(targets)
            removed += targets
        # The kept root goes with the last image of its hash (a second import of
        # the same hash, under another id, keeps it).
        left = [e for e in _podman.list_labelled(f"{HASH_LABEL}={key}") if _entry_key(e) == key]
        d = images / key
        if d.exists() and not left:
            safe_rmtree(d)
            removed.append(str(d))
    if not removed:
        raise ImageError(f"no image with hash {key} (see `agentbox image ls`)")
    return removed
