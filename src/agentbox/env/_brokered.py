"""The host's brokered credentials for one phase: the proxy's rules and the sandbox's clean config.

:func:`brokered_rules` asks :func:`agentbox.egress.brokered_for_phase` what
the host brokers for the phase (setup: the submitting user's pip/npm credentials; the
agent phase with ``[git] fetch``: the remote's) and puts those rules with the
Boxfile's in the proxy's order (:func:`~agentbox.egress.combine`).
:func:`sandbox_config` gives the phase's variables (registries and remote named with
no credential) and writes the credential-free npmrc next to the CA bundle, in the
read-only directory the sandbox mounts at ``/run/agentbox/ca``. The values go to the
proxy only (``start_egress(secret_values=...)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.config import Settings
from agentbox.env._egress import CA_DIR_IN_SANDBOX, CA_IN_SANDBOX, EGRESS_PORT

if TYPE_CHECKING:
    from agentbox.boxfile import Boxfile
    from agentbox.egress import Brokered
    from agentbox.egress.rules import NetworkRule
    from agentbox.env._egress import Egress

#: The credential-free npmrc a phase with brokered npm registries gets.
NPMRC_IN_SANDBOX = f"{CA_DIR_IN_SANDBOX}/npmrc"


def brokered_rules(
    settings: Settings, box: Boxfile, *, phase: str, uid: int | None, repo: Path | None
) -> tuple[Brokered, tuple[NetworkRule, ...]]:
    """(what the host brokers for ``phase``, all the phase's request rules in order)."""
    from agentbox.egress import brokered_for_phase, combine

    brokered = brokered_for_phase(
        settings, phase=phase, uid=uid, repo=repo,
        registries=box.setup is not None and box.setup.network == "registries",
        git_remote=box.git.remote if box.git.fetch else None,
        git_secret=box.git.secret, git_user=box.git.user,
        proxy_url=f"http://127.0.0.1:{EGRESS_PORT}", ca_path=CA_IN_SANDBOX,
    )  # fmt: skip
    return brokered, combine(box.network_rules(phase), brokered)


def sandbox_config(settings: Settings, egress: Egress, brokered: Brokered) -> dict[str, str]:
    """The phase's extra variables; the npmrc (if any) written beside the CA bundle."""
    env = dict(brokered.env)
    if brokered.npmrc:
        path = egress.mount.source / "npmrc"
        tmp = path.with_name(".npmrc.new")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
        with os.fdopen(fd, "w") as fh:
            fh.write(brokered.npmrc)
        uid = settings.sandbox_host_uid
        os.chown(tmp, uid, uid, follow_symlinks=False)
        tmp.replace(path)
        env["npm_config_userconfig"] = NPMRC_IN_SANDBOX
    return env
