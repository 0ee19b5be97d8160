"""The docker backend: hardened Docker Engine containers (runc, or runsc/gVisor).

The seed's own engine: every line of its agent-container list, set
through the official ``docker`` SDK behind an allow-list of Engine calls
(:mod:`._client`), the image imported from the same content-hashed root podman
runs (:mod:`._image`). See docs/reference/docker-backend.md.
"""

from agentbox.backends.docker._backend import DockerBackend
from agentbox.backends.docker._client import ALLOWED, LIFE, GuardedClient
from agentbox.backends.docker._config import DaemonFacts
from agentbox.backends.docker._facility import doctor_rows, facility
from agentbox.backends.docker._sandbox import DockerSandbox

__all__ = [
    "ALLOWED",
    "LIFE",
    "DaemonFacts",
    "DockerBackend",
    "DockerSandbox",
    "GuardedClient",
    "doctor_rows",
    "facility",
]
