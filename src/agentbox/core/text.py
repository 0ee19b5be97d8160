"""Untrusted text made safe to print: control characters shown, never obeyed.

What the sandboxed agent wrote (its final message, file contents in a diff,
file names, log lines) reaches the user's terminal through ``agentbox run``,
``show``, ``logs`` and ``tasks``, and the host agent through the MCP tools. A
terminal obeys escape sequences: OSC 52 writes the clipboard, OSC 0 sets the
title, OSC 8 makes a hyperlink whose text lies about its target, ``CSI 2J``
clears the screen, a lone CR overwrites a line, and C1 ``0x9b`` is a CSI on
terminals that read 8-bit controls. :func:`visible` turns every such character
into its backslash escape (``\\x1b``, ``\\x9b``, ``\\r``), so the bytes that reach
the terminal are printable text whatever the agent wrote.

Kept as they are: ``\\n``, ``\\t`` and the ``\\r`` of a CRLF line end (a carriage
return right before a newline overwrites nothing, and diffs of CRLF files stay
readable). Escaped: the other C0 controls, DEL, the C1 controls
(U+0080..U+009F), the Unicode bidirectional overrides and isolates (the
"Trojan Source" reordering of a diff line), and lone surrogates (undecodable
bytes, which would otherwise crash the print).

Print the result as plain text (``rich.text.Text``), never as rich markup: a
``[link=...]`` tag in the agent's text must stay text.
"""

from __future__ import annotations

import re

__all__ = ["has_controls", "visible"]

# C0 but \t and \n; a CR not followed by LF; DEL and C1; bidi controls; lone surrogates.
_UNSAFE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
    "\ud800-\udfff]|\r(?!\n)"
)


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c == "\r":
        return "\\r"
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character a terminal could act on shown as an escape."""
    return _UNSAFE.sub(_escape, text)


def has_controls(text: str) -> bool:
    """Whether :func:`visible` would change ``text``."""
    return _UNSAFE.search(text) is not None
