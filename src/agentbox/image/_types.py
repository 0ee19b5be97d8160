"""The value objects of the image layer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Label put on every image agentbox builds; its value is the image's content hash.
HASH_LABEL = "io.agentbox.image.hash"


@dataclass(frozen=True)
class ImageInfo:
    """A sandbox image as the backends see it.

    ``name`` is what podman runs (``localhost/agentbox-default:latest`` or any
    local image the user named). ``hash`` is the content hash of an image
    agentbox built (None for a foreign image); ``rootfs`` the kept root
    directory the microVM backend turns into a disk (None when there is none);
    ``podman_id`` the image id in podman's storage (None when it is not imported).
    ``cached`` is True when :func:`agentbox.image.build_default` found everything
    already built and did no work.
    """

    name: str
    hash: str | None
    rootfs: Path | None
    podman_id: str | None
    cached: bool = False
