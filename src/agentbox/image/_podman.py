"""The few podman image calls the image layer needs, with errors translated.

Image references given by users are checked before they reach podman's argv,
so a name can never be read as an option.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError, CommandError, ImageError

# A podman/OCI image reference: registry/path:tag or @digest, or a bare image id.
_REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,255}")


def _run(argv: Sequence[str], *, timeout: float = 120, check: bool = True) -> _proc.Result:
    """``_proc.run`` with a missing podman binary reported as ImageError."""
    try:
        return _proc.run(argv, timeout=timeout, check=check)
    except FileNotFoundError as exc:
        raise ImageError(f"podman not found ({exc.filename}): apt-get install podman") from exc


def valid_reference(name: str) -> bool:
    """True if ``name`` looks like an image reference podman may be given."""
    return isinstance(name, str) and _REF_RE.fullmatch(name) is not None


def check_reference(name: str) -> str:
    """Return ``name`` if it looks like an image reference, else raise ImageError."""
    if not isinstance(name, str) or not _REF_RE.fullmatch(name):
        raise ImageError(f"not a valid image name: {name!r:.80}")
    return name


def inspect(name: str) -> dict[str, Any] | None:
    """``podman image inspect`` of ``name`` as a dict, or None when podman has no such image."""
    check_reference(name)
    try:
        res = _run(["podman", "image", "inspect", "--format", "json", name], check=False)
    except AgentboxError as exc:
        raise ImageError(f"podman image inspect {name} failed: {exc}") from exc
    if res.returncode != 0:
        return None
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise ImageError(f"podman image inspect {name}: unreadable output") from exc
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    return data[0]


def labels_of(info: dict[str, Any]) -> dict[str, str]:
    """The labels of an inspected image (podman puts them in two places)."""
    labels = info.get("Labels") or (info.get("Config") or {}).get("Labels") or {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def list_labelled(label: str) -> list[dict[str, Any]]:
    """Every local image carrying ``label`` (``podman images --format json``).

    ``podman images`` fails ("image not known") when an image it is listing is
    removed meanwhile by someone else; the listing is then taken again.
    """
    argv = ["podman", "images", "--filter", f"label={label}", "--format", "json"]
    for attempt in range(3):
        try:
            res = _run(argv, timeout=60)
            data = json.loads(res.stdout or "[]")
            break
        except CommandError as exc:
            if attempt < 2 and "image not known" in f"{exc.stderr} {exc.stdout}":
                continue
            raise ImageError(f"cannot list podman images: {exc}") from exc
        except (AgentboxError, json.JSONDecodeError) as exc:
            raise ImageError(f"cannot list podman images: {exc}") from exc
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def import_tarball(tarball: Path, *, reference: str, changes: Sequence[str]) -> str:
    """``podman import`` a root tarball as ``reference``; return the new image id."""
    argv: list[str] = ["podman", "import", "--quiet"]
    for change in changes:
        argv += ["--change", change]
    argv += ["--message", "agentbox image build", str(tarball), check_reference(reference)]
    try:
        res = _run(argv, timeout=900)
    except CommandError as exc:
        raise ImageError(f"podman import of {tarball} failed: {exc}") from exc
    out = res.stdout.strip().splitlines()
    return out[-1].removeprefix("sha256:") if out else ""


def tag(source: str, target: str) -> None:
    """Tag image ``source`` as ``target``."""
    try:
        _run(["podman", "tag", check_reference(source), check_reference(target)])
    except CommandError as exc:
        raise ImageError(f"podman tag {source} {target} failed: {exc}") from exc


def remove_names(names: Sequence[str]) -> None:
    """Untag each name; podman deletes the image with its last name.

    Never ``--force``: that would also remove containers still using the image.
    """
    if not names:
        return
    try:
        _run(["podman", "rmi", *(check_reference(n) for n in names)], timeout=120)
    except CommandError as exc:
        raise ImageError(
            f"podman rmi {' '.join(names)} failed (is a sandbox still using it?): {exc}"
        ) from exc
