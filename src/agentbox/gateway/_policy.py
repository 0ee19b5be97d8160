"""What of a request may reach the upstream: allow-lists per model kind, checked before forwarding.

Nothing the sandbox sends passes through unchecked. Each part
of a Messages request is held against an allow-list the registry declares per
model kind (:class:`RequestPolicy`):

- top-level fields: allowed ones are kept (some with their own keys
  allow-listed), unknown ones are **stripped** (the seed: "strip fields the
  upstream does not support");
- fields, content blocks, sources, tools and ``anthropic-beta`` values that
  would make the upstream **reach the network** (``mcp_servers``, ``container``,
  server tools such as ``web_fetch_*``/``web_search_*``/``code_execution_*``,
  ``url`` or ``file`` sources, the MCP, files and skills betas …) are **refused**
  with a 400 that names them: that would be egress, which the threat model
  forbids, and their tokens (fetched pages, search and tool results) are not in
  the body, so the budget's reservation would no longer bound them;
- content block types and ``source.type`` values outside the lists are refused
  too (an unknown block cannot be dropped without changing what the request
  means); tools must be client tools (``name`` + ``input_schema``).

The check also counts what the body's bytes do not bound: images (a tiny,
highly compressed image still costs up to the entry's ``image_tokens``), PDF
documents (``document_tokens`` each) and ``tool_reference`` blocks (each may
load a tool definition), so the reservation stays a true upper bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agentbox.errors import PolicyViolation

#: Top-level fields that make the upstream reach the network (or data outside the body).
NETWORK_FIELDS: dict[str, str] = {
    "mcp_servers": "it makes the upstream connect to MCP servers",
    "container": "it runs code in an upstream container with its own files",
    "skills": "it loads skills into an upstream container",
}
#: Content block types produced by server-side tools (network, code execution, MCP).
NETWORK_BLOCK_TYPES = frozenset(
    {
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
    }
)
#: ``tools[].type`` prefixes of server tools the upstream runs itself.
NETWORK_TOOL_PREFIXES = (
    "web_search",
    "web_fetch",
    "code_execution",
    "mcp_toolset",
    "tool_search_tool",
    "memory",
)
#: ``anthropic-beta`` prefixes that turn on network-reaching features.
NETWORK_BETA_PREFIXES = (
    "mcp-client-",
    "web-fetch-",
    "web-search-",
    "code-execution-",
    "files-api-",
    "skills-",
    "container-",
)
#: The betas Claude Code 2.1.332 sends on every request (recorded, see replay-script.md).
CLAUDE_CODE_BETAS = (
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "per-turn-control-2026-07-01",
    "mid-conversation-tool-changes-2026-07-01",
    "thinking-token-count-2026-05-13",
    "advanced-tool-use-2025-11-20",
    "effort-2025-11-24",
)
DEFAULT_BETAS = (
    *CLAUDE_CODE_BETAS,
    "prompt-caching-2024-07-31",
    "token-efficient-tools-2025-02-19",
    "fine-grained-tool-streaming-2025-05-14",
    "output-128k-2025-02-19",
    "token-counting-2024-11-01",
    "structured-outputs-2025-11-13",
)
#: Top-level fields admitted by default (anything else is stripped).
DEFAULT_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "stream",
    "metadata",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "context_management",
    "output_config",
    "output_format",
)
DEFAULT_BLOCK_TYPES = (
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "tool_reference",
)
#: Keys kept inside the small structured fields; others are stripped.
_SUBKEYS: dict[str, frozenset[str]] = {
    "metadata": frozenset({"user_id"}),
    "thinking": frozenset({"type", "budget_tokens", "display"}),
    "output_config": frozenset({"effort", "format"}),
    "tool_choice": frozenset({"type", "name", "disable_parallel_tool_use"}),
    "context_management": frozenset({"edits"}),
}
_TOOL_KEYS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "cache_control",
        "type",
        "strict",
        "defer_loading",
        "input_examples",
        "eager_input_streaming",
    }
)
_TOOL_CHOICES = frozenset({"auto", "any", "tool", "none"})
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_ROLES = frozenset({"user", "assistant", "system"})


@dataclass(frozen=True)
class RequestPolicy:
    """The allow-lists for one model entry (built by :attr:`ModelEntry.policy`)."""

    fields: frozenset[str] = frozenset(DEFAULT_FIELDS)
    block_types: frozenset[str] = frozenset(DEFAULT_BLOCK_TYPES)
    source_types: frozenset[str] = frozenset({"base64", "text"})
    betas: frozenset[str] = frozenset(DEFAULT_BETAS)
    image_tokens: int = 5_000
    """Worst-case input tokens of one image (the API bills at most ~1,600 for the
    largest it keeps; the margin covers models that keep more pixels)."""
    document_tokens: int = 1_800_000
    """Worst-case input tokens of one base64 PDF (600 pages at 3,000 tokens)."""


@dataclass
class Admitted:
    """What :func:`check_request` found: the fields it stripped and the hidden costs."""

    stripped: list[str] = field(default_factory=list)
    images: int = 0
    pdfs: int = 0
    tool_references: int = 0

    def extra_tokens(self, policy: RequestPolicy, tools_bytes: int) -> int:
        """Input tokens the body's bytes do not bound."""
        return (
            self.images * policy.image_tokens
            + self.pdfs * policy.document_tokens
            + self.tool_references * tools_bytes
        )


def filter_betas(values: Iterable[str], policy: RequestPolicy) -> list[str]:
    """The allowed betas among ``values`` (comma-separated header values), in order.

    Raises :class:`PolicyViolation` for a network-reaching beta; unknown ones are dropped.
    """
    out: list[str] = []
    for value in values:
        for beta in (b.strip() for b in value.split(",")):
            if not beta:
                continue
            if beta.lower().startswith(NETWORK_BETA_PREFIXES):
                raise PolicyViolation(
                    f"anthropic-beta {beta!r} is not allowed: it turns on a feature that "
                    "makes the upstream reach the network"
                )
            if beta in policy.betas and beta not in out:
                out.append(beta)
    return out


def check_request(req: dict[str, Any], policy: RequestPolicy) -> Admitted:
    """Hold ``req`` against ``policy`` in place: strip what is unknown, refuse what reaches out.

    Raises :class:`PolicyViolation` naming the first part refused.
    """
    seen = Admitted()
    for name in list(req):
        if name in NETWORK_FIELDS:
            raise PolicyViolation(
                f"{name}: not allowed through the gateway: {NETWORK_FIELDS[name]}"
            )
        if name not in policy.fields:
            del req[name]
            seen.stripped.append(name)
    for name, keys in _SUBKEYS.items():
        value = req.get(name)
        if isinstance(value, dict):
            for k in [k for k in value if k not in keys]:
                del value[k]
                seen.stripped.append(f"{name}.{k}")
    _check_tool_choice(req.get("tool_choice"))
    _check_context_management(req.get("context_management"))
    tools = req.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise PolicyViolation("tools: must be a list")
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]", seen)
    system = req.get("system")
    if isinstance(system, list):
        _check_blocks(system, "system", policy, seen, top=True)
    messages = req.get("messages")
    if isinstance(messages, list):
        for i, msg in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(msg, dict):
                raise PolicyViolation(f"{where}: must be an object")
            if msg.get("role") not in _ROLES:
                raise PolicyViolation(f"{where}.role: must be one of user, assistant, system")
            for k in [k for k in msg if k not in ("role", "content")]:
                del msg[k]
                seen.stripped.append(f"{where}.{k}")
            content = msg.get("content")
            if isinstance(content, list):
                _check_blocks(content, f"{where}.content", policy, seen, top=True)
            elif not isinstance(content, str):
                raise PolicyViolation(f"{where}.content: must be a string or a list of blocks")
    return seen


def _check_tool_choice(choice: Any) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
        raise PolicyViolation("tool_choice: type must be one of auto, any, tool, none")


def _check_context_management(cm: Any) -> None:
    if cm is None:
        return
    edits = cm.get("edits", []) if isinstance(cm, dict) else None
    if not isinstance(edits, list):
        raise PolicyViolation("context_management: edits must be a list")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str) or not kind.startswith("clear_"):
            raise PolicyViolation(f"context_management.edits[{i}].type: only clear_* edits")


def _check_tool(tool: Any, where: str, seen: Admitted) -> None:
    if not isinstance(tool, dict):
        raise PolicyViolation(f"{where}: must be an object")
    kind = tool.get("type")
    if kind is not None and kind != "custom":
        if isinstance(kind, str) and kind.startswith(NETWORK_TOOL_PREFIXES):
            raise PolicyViolation(
                f"{where}: server tool {kind!r} is not allowed: it makes the upstream reach "
                "the network or run code; only client tools (name + input_schema) pass"
            )
        raise PolicyViolation(
            f"{where}: tool type {kind!r} is not allowed; only client tools "
            "(name + input_schema) pass"
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise PolicyViolation(f"{where}: a client tool needs a string name and an input_schema")
    for k in [k for k in tool if k not in _TOOL_KEYS]:
        del tool[k]
        seen.stripped.append(f"{where}.{k}")


def _check_blocks(
    blocks: list[Any], where: str, policy: RequestPolicy, seen: Admitted, *, top: bool
) -> None:
    for j, block in enumerate(blocks):
        here = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise PolicyViolation(f"{here}: a content block must be an object")
        kind = block.get("type")
        if kind in NETWORK_BLOCK_TYPES:
            raise PolicyViolation(
                f"{here}: block type {kind!r} is not allowed: it comes from a server tool "
                "that reaches the network or runs code upstream"
            )
        if not isinstance(kind, str) or kind not in policy.block_types:
            raise PolicyViolation(f"{here}: block type {kind!r} is not allowed")
        if kind == "tool_reference":
            seen.tool_references += 1
        elif kind in ("image", "document"):
            _check_source(block, kind, here, policy, seen)
        elif kind == "tool_result":
            inner = block.get("content")
            if isinstance(inner, list):
                _check_blocks(inner, f"{here}.content", policy, seen, top=False)
            elif inner is not None and not isinstance(inner, str):
                raise PolicyViolation(f"{here}.content: must be a string or a list of blocks")
        if not top and kind not in ("text", "image", "document", "tool_reference"):
            raise PolicyViolation(f"{here}: block type {kind!r} is not allowed in a tool result")


def _check_source(
    block: dict[str, Any], kind: str, where: str, policy: RequestPolicy, seen: Admitted
) -> None:
    source = block.get("source")
    if not isinstance(source, dict):
        raise PolicyViolation(f"{where}.source: must be an object")
    stype = source.get("type")
    if stype in ("url", "file"):
        raise PolicyViolation(
            f"{where}.source.type {stype!r} is not allowed: the upstream would fetch it "
            "(only base64 and text sources pass)"
        )
    if stype not in policy.source_types or (kind == "image" and stype != "base64"):
        raise PolicyViolation(f"{where}.source.type {stype!r} is not allowed")
    if not isinstance(source.get("data"), str):
        raise PolicyViolation(f"{where}.source.data: must be a string")
    media = source.get("media_type")
    if kind == "image":
        if media not in _IMAGE_TYPES:
            raise PolicyViolation(f"{where}.source.media_type {media!r} is not allowed")
        seen.images += 1
    elif stype == "base64":
        if media != "application/pdf":
            raise PolicyViolation(f"{where}.source.media_type {media!r} is not allowed")
        seen.pdfs += 1
    elif media not in (None, "text/plain"):
        raise PolicyViolation(f"{where}.source.media_type {media!r} is not allowed")
