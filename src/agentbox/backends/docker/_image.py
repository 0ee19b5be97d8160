"""The sandbox image in Docker's store: imported from the same content-hashed root podman runs.

No registry is involved. ``agentbox image build`` keeps the verified root of the
image it built under ``<cache>/images/<hash>/rootfs``; the first docker sandbox
of that hash packs the root and imports it (``POST /images/create?fromSrc=-``)
as ``localhost/agentbox-docker:<hash>``, with the podman image's environment and
labels. A later sandbox finds it by that name (``GET /images/{name}/json``).
"""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path
from typing import Any

from agentbox.backends.docker._client import GuardedClient
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, CommandError, ImageError

log = get_logger(__name__)

DOCKER_REPO = "localhost/agentbox-docker"
_lock = threading.Lock()
_ids: dict[str, str] = {}


def _not_found(exc: Exception) -> bool:
    return getattr(getattr(exc, "response", None), "status_code", None) == 404


def _podman_config(image: str) -> dict[str, Any]:
    try:
        res = _proc.run(["podman", "image", "inspect", "--format", "{{json .Config}}", image],
                        timeout=60)  # fmt: skip
        data = json.loads(res.stdout or "{}")
    except (CommandError, json.JSONDecodeError) as exc:
        raise ImageError(f"cannot read the config of {image} from podman: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _changes(config: dict[str, Any]) -> list[str]:
    out = []
    for item in config.get("Env") or []:
        k, sep, v = str(item).partition("=")
        if sep and k and "\n" not in item:
            out.append(f"ENV {k}={json.dumps(v)}")
    labels = config.get("Labels") or {}
    if isinstance(labels, dict):
        out += [f"LABEL {k}={json.dumps(str(v))}" for k, v in sorted(labels.items())
                if "\n" not in f"{k}{v}" and " " not in str(k)]  # fmt: skip
    return out


def ensure_image(client: GuardedClient, settings: Settings, image: str) -> str:
    """The Docker image id for agentbox image ``image`` (imported now if missing)."""
    with _lock:
        if image in _ids:
            return _ids[image]
    from agentbox.image import resolve

    info = resolve(settings, image)
    if info.hash is None or info.rootfs is None:
        raise ImageError(
            f"the docker backend runs images agentbox built (with a kept root); {image} has "
            "none: run `agentbox image build`, or use the podman backend for this image"
        )
    ref = f"{DOCKER_REPO}:{info.hash}"
    try:
        got = client.api.inspect_image(ref)
    except Exception as exc:  # docker.errors.NotFound / APIError
        if not _not_found(exc):
            raise ImageError(f"docker image inspect {ref}: {exc}") from exc
        got = None
    if got is None:
        _import(client, settings, info.rootfs, ref, _changes(_podman_config(info.name)))
        got = client.api.inspect_image(ref)
    image_id = str(got.get("Id") or "")
    if not image_id:
        raise ImageError(f"docker reports no id for {ref}")
    with _lock:
        _ids[image] = image_id
    return image_id


def forget_images() -> None:
    """Drop the per-process cache (after an image was found missing)."""
    with _lock:
        _ids.clear()


def _import(
    client: GuardedClient, settings: Settings, root: Path, ref: str, changes: list[str]
) -> None:
    work = settings.cache_dir / "docker"
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    tarball = work / f".tmp-import-{secrets.token_hex(4)}.tar"
    log.info("importing the image into docker", image=ref, root=str(root))
    try:
        _proc.run(["tar", "--create", "--file", str(tarball), "--numeric-owner",
                   "--one-file-system", "-C", str(root), "."], timeout=900)  # fmt: skip
        repo, _, tag = ref.rpartition(":")
        client.api.import_image_from_file(str(tarball), repository=repo, tag=tag, changes=changes)
    except (AgentboxError, OSError) as exc:
        raise ImageError(f"cannot import {root} into docker: {exc}") from exc
    except Exception as exc:  # the SDK's APIError
        raise ImageError(f"docker import of {root} failed: {exc}") from exc
    finally:
        tarball.unlink(missing_ok=True)
