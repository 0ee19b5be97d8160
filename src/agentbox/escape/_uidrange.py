"""``host.uid_own_range``: a sandbox's host uids are no other live sandbox's.

A neighbour sandbox of the same backend is started beside the probed one, holding a
uid slot of its own (``agentbox.backends._uidslots``), and every thread of both is
read from the host: no host uid may be in both. The control (``shared``) starts two
hardened podman sandboxes forced onto one range (the same slot, as every sandbox was
before uid slots): the probe must fire.
"""

from __future__ import annotations

from agentbox.backends import get_backend, uid_slot
from agentbox.backends.base import Backend, SandboxSpec
from agentbox.config import Settings
from agentbox.escape import _hostcheck as hc
from agentbox.escape._hostview import sandbox_pids
from agentbox.escape._model import Outcome, Status
from agentbox.escape._probeio import _outcome
from agentbox.escape._registry import by_id

PROBE = "host.uid_own_range"
#: gVisor's Sentry: runsc started as root runs it as the host's nobody in a user namespace
#: of its own, with that one id mapped (hard-coded in runsc's sandbox start); every
#: gVisor sandbox's Sentry shares it. The gofer runs as the slot's mapped root.
SENTRY_UID = 65534


def _uids(pids: list[int]) -> set[int]:
    return {u for t in hc.read_threads(pids) for u in t.uids}


def verdict(
    own: list[int],
    theirs: list[int],
    *,
    applies: bool = True,
    sentry: bool = False,
    one_root: int | None = None,
) -> Outcome:
    """The probe's outcome from the host pids of the probed sandbox and of its neighbour.

    ``sentry`` (gVisor): the Sentry's nobody is said, not counted (see SENTRY_UID).
    ``one_root``: both map into one range whose root is this id (docker's remap range:
    no per-container map); when that root is all they share (gVisor's gofer runs as it)
    the probe is n/a there, said so; any other shared id fails."""
    spec = by_id(PROBE)
    mine, other = _uids(own), _uids(theirs)
    status: Status
    if not applies:
        status = "n/a"
        seen = f"standard isolation runs every VMM as your uid by design: {sorted(mine)}"
    elif not mine or not other:
        status, seen = "error", f"no readable thread (own pids {own}, neighbour's {theirs})"
    else:
        both = mine & other
        shared = sorted(both - ({SENTRY_UID} if sentry else set()))
        status = "fail" if shared else "pass"
        seen = f"host uids {sorted(mine)} vs the neighbour's {sorted(other)}; shared {shared}"
        if shared and shared == [one_root]:
            status = "n/a"
            seen += (
                f": {one_root} is the root of the one remap range every sandbox of this "
                "backend maps into (gVisor's gofer runs as it); no per-container map here"
            )
        if sentry and SENTRY_UID in both:
            seen += f" (gVisor's Sentry runs as the host's nobody, {SENTRY_UID}, in every sandbox)"
    return _outcome(spec, status, seen)


def _bare(spec: SandboxSpec, suffix: str) -> SandboxSpec:
    """A neighbour of ``spec``: same image, runtime, isolation, no workspace or mounts."""
    return spec.replace(name=f"{spec.name}-{suffix}", workspace=None, gateway_dir=None, mounts=())


def neighbour_outcome(
    backend: Backend, settings: Settings, spec: SandboxSpec, own: list[int], *, vm: bool
) -> Outcome:
    """Start a neighbour of ``spec`` in a slot of its own and compare host uids."""
    if vm and spec.isolation != "strict":
        return verdict(own, own, applies=False)
    sentry = not vm and not backend.shares_host_kernel(spec.runtime)
    with (
        uid_slot(settings, backend.name, "escape-nb") as nb_settings,
        get_backend(backend.name, nb_settings).create(
            _bare(spec, "nb").replace(uid=nb_settings.sandbox_uid)
        ) as nb,
    ):
        # Both in one range (docker's remap range: a uid of its own inside it, not a range).
        one_root = (
            settings.sandbox_subid_base
            if settings.uid_slot is None and nb_settings.uid_slot is None
            else None
        )
        return verdict(own, sandbox_pids(nb), sentry=sentry, one_root=one_root)


def shared_range_control(settings: Settings, image: str, spec: SandboxSpec) -> Outcome:
    """Two hardened podman (runc) sandboxes on one range: the probe must fire."""
    from agentbox.escape._controls import control_outcome

    backend = get_backend("podman", settings)
    base = _bare(spec.replace(image=image, runtime="runc", isolation="standard"), "shared")
    with (
        backend.create(base.replace(name=base.name + "-a")) as a,
        backend.create(base.replace(name=base.name + "-b")) as b,
    ):
        probe = verdict(sandbox_pids(a), sandbox_pids(b))
    return control_outcome(by_id(PROBE), probe, "shared")
