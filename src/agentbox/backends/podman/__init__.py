"""The podman backend: hardened OCI containers under runc, crun or runsc (gVisor).

The package holds what is podman's alone: the backend (``_backend``), its
sandbox (``_sandbox``), detached sandboxes (``_detach``) and conmon's cgroup
placement (``_cgroup``). What podman shares with the docker backend lives one
level up: the live container sandbox it extends (``backends._oci_sandbox``:
exec, copy in and out, host pids, teardown; this package adds the ``podman``
calls), the hardening flags (``backends._oci_args``), the CLI helpers
(``backends._oci_cli``), the posture reader (``backends._oci_posture``), the
workspace disk (``backends._wsdisk``) and the ``k8s-file`` log reader
(``backends._k8slog``).
"""

from agentbox.backends.oci._args import image_facts
from agentbox.backends.oci._cli import conmon_cwd
from agentbox.backends.oci._userns_limits import (
    HOST_SANDBOXES,
    HOST_SYSCTLS,
    SANDBOX_CAPS,
    host_shortfall,
)
from agentbox.backends.podman._backend import PodmanBackend
from agentbox.backends.podman._doctor import doctor_rows, facility
from agentbox.backends.podman._pool_view import claim_record
from agentbox.backends.podman._sandbox import PodmanSandbox

__all__ = [
    "HOST_SANDBOXES",
    "HOST_SYSCTLS",
    "SANDBOX_CAPS",
    "PodmanBackend",
    "PodmanSandbox",
    "claim_record",
    "conmon_cwd",
    "doctor_rows",
    "facility",
    "host_shortfall",
    "image_facts",
]
