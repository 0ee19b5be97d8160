"""Secrets on the host: a per-user store the sandbox never sees, and ``${secret:NAME}`` references.

::

    from agentbox.secrets import SecretStore, find_refs, expand
    store = SecretStore(settings)                       # <data_dir>/secrets/, root-only
    store.set("CORP_PYPI_TOKEN", value, owner_uid=1000)
    values = store.resolve(find_refs("Bearer ${secret:CORP_PYPI_TOKEN}"), owner_uid=1000)
    header = expand("Bearer ${secret:CORP_PYPI_TOKEN}", values)   # in the proxy only

The format, the permissions and who may use what: ``docs/reference/secrets.md``.
"""

from __future__ import annotations

from agentbox.secrets._refs import NAME_RE, PLACEHOLDER, check_name, expand, find_refs
from agentbox.secrets._store import (
    MAX_VALUE,
    SecretInfo,
    SecretStore,
    check_value,
    resolve_for_task,
)

__all__ = [
    "MAX_VALUE",
    "NAME_RE",
    "PLACEHOLDER",
    "SecretInfo",
    "SecretStore",
    "check_name",
    "check_value",
    "expand",
    "find_refs",
    "resolve_for_task",
]
