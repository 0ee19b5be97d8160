"""``${secret:NAME}`` references in a template: which names it names, and its expansion.

A Boxfile names secrets, it never reads them: the only place a reference is expanded is
an egress rule's ``inject`` value, in the proxy's memory, on the way out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agentbox.errors import InvalidValue, SecretNotFound

#: What the sandbox may see where a tool insists on having a token: never the value.
PLACEHOLDER = "agentbox-brokered"

#: A secret's name: an environment-variable-like word, upper case, at most 64 characters.
NAME_RE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
_REF = re.compile(r"\$\{secret:([^}]*)\}")
_OPEN = "${secret:"


def check_name(name: str) -> str:
    """``name`` if it is a valid secret name, else :class:`~agentbox.errors.InvalidValue`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidValue(
            [
                (
                    "secret name",
                    f"{name!r:.80} is not A-Z, 0-9 and _, starting with a letter, 1-64 long",
                )
            ]
        )
    return name


def find_refs(template: str) -> list[str]:
    """The secret names ``template`` references, in order, each once.

    ``"Bearer ${secret:X}"`` gives ``["X"]``. A bad name or an unclosed ``${secret:`` is
    an :class:`~agentbox.errors.InvalidValue` naming it.
    """
    names: list[str] = []
    for m in _REF.finditer(template):
        name = check_name(m.group(1))
        if name not in names:
            names.append(name)
    if _REF.sub("", template).find(_OPEN) >= 0:
        raise InvalidValue([("secret reference", "an unclosed ${secret: (write ${secret:NAME})")])
    return names


def expand(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each ``${secret:NAME}`` replaced by ``values[NAME]``.

    One pass, so a value that itself contains ``${secret:...}`` is not expanded again.
    A name missing from ``values`` is :class:`~agentbox.errors.SecretNotFound`.
    """
    find_refs(template)  # the same checks, before anything is substituted

    def sub(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise SecretNotFound(m.group(1)) from None

    return _REF.sub(sub, template)
