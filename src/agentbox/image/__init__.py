"""Sandbox images: build the default one without any registry, find any local one.

The default image is a Debian root made by mmdebstrap from the host's own apt
sources, plus the pinned Claude Code binary and our guest programs, hardened
(no package manager, no su/sudo, no setuid/setgid) and verified by reading the
result. It is cached by content hash, imported into podman as
``localhost/agentbox-default:{latest,<hash>}``, and its root directory is kept
for the microVM backend. Its Debian root without our layer is
``localhost/agentbox-base``, the usual ``FROM`` of a user's Containerfile;
:func:`build_containerfile` adds our layer to such a build and hardens and
verifies it the same way. See docs/reference/image.md.
"""

from agentbox.image._build import build_default, images_dir
from agentbox.image._containerfile import (
    BASE_IMAGE,
    CUSTOM_REPO,
    build_containerfile,
    build_for_boxfile,
)
from agentbox.image._harden import verify
from agentbox.image._keys import SUITE, host_apt_sources
from agentbox.image._manage import list_images, manifest, remove, resolve
from agentbox.image._types import HASH_LABEL, ImageInfo

__all__ = [
    "BASE_IMAGE",
    "CUSTOM_REPO",
    "HASH_LABEL",
    "SUITE",
    "ImageInfo",
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
