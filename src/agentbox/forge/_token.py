"""The forge token a pull request is opened with: the user's secret, else their environment.

First the user's own ``agentbox secret`` (or one root shared) of the forge's name
(``GITHUB_TOKEN`` then ``GH_TOKEN`` on GitHub, ``GITLAB_TOKEN`` on GitLab), read
from the host's store (root's to read: the launcher's side); then the same names
in the environment of the user running ``publish``. The value is handed to the
forge's client only: never logged, never in an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from agentbox.config import Settings
from agentbox.errors import ForgeError, SecretNotFound, SecretStoreError
from agentbox.forge._remote import Kind

TOKEN_NAMES: dict[str, tuple[str, ...]] = {
    "github": ("GITHUB_TOKEN", "GH_TOKEN"),
    "gitlab": ("GITLAB_TOKEN",),
}


def _from_store(settings: Settings, name: str, uid: int) -> str | None:
    if os.geteuid() != 0:
        return None  # the store is root's: an unprivileged caller has only its environment
    try:
        from agentbox.secrets import SecretStore
    except ImportError:  # pragma: no cover - the store ships with agentbox
        return None
    try:
        return SecretStore(settings).resolve([name], uid).get(name)
    except (SecretNotFound, SecretStoreError):
        return None


def forge_token(
    kind: Kind, settings: Settings, *, uid: int, env: Mapping[str, str] | None = None
) -> str:
    """The token for ``kind`` of user ``uid``; :class:`~agentbox.errors.ForgeError` naming
    the ways to give one when there is none."""
    names = TOKEN_NAMES[kind]
    for name in names:
        value = _from_store(settings, name, uid)
        if value:
            return value
    environ = os.environ if env is None else env
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    raise ForgeError(
        f"no {kind} token for uid {uid}: set one with `agentbox secret set {names[0]}` "
        f"(or export {names[0]} where you run agentbox publish)"
    )
