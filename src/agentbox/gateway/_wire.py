"""Messages-API wire helpers shared by the gateway and the replay model.

Raw ASGI on purpose: two routes do not need a framework's request objects,
and owning the receive loop lets the gateway cap body sizes while reading and
notice a client that hangs up mid-stream.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from agentbox.errors import BodyTooLarge

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Anthropic's error type for each status the gateway and the replay model emit.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def new_id(prefix: str) -> str:
    """An id in Anthropic's style (``msg_…``, ``toolu_…``, ``req_…``), unique per call."""
    return f"{prefix}_{secrets.token_hex(12)}"


def error_body(status: int, message: str, err_type: str | None = None) -> bytes:
    """An Anthropic-style error document."""
    doc = {
        "type": "error",
        "error": {"type": err_type or ERROR_TYPES.get(status, "api_error"), "message": message},
        "request_id": new_id("req"),
    }
    return json.dumps(doc).encode()


def header(scope: Scope, name: bytes) -> list[bytes]:
    """All values of header ``name`` (lower-case bytes) in the request."""
    return [v for k, v in scope.get("headers", ()) if k.lower() == name]


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send a complete JSON response."""
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send,
    status: int,
    message: str,
    err_type: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send an Anthropic-style error response."""
    await send_json(send, status, error_body(status, message, err_type), headers)


async def read_body(receive: Receive, limit: int) -> bytes:
    """Read the whole request body; :class:`BodyTooLarge` as soon as it passes ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = msg.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


#: Parsing may cost at most this many times the body, plus :data:`COST_SLACK` bytes.
COST_RATIO = 10
COST_SLACK = 4 << 20
_WIDE4 = re.compile(rb"[\xf0-\xf4]")
_WIDE2 = re.compile(rb"[\xe0-\xef]")


def json_cost(body: bytes) -> int:
    """An upper bound of the memory, in bytes, that ``json.loads(body)`` can take at its peak.

    Counted in one pass of C per byte class, before parsing: the decoded text (1, 2
    or 4 bytes per character, by the widest character present), plus, for each
    structural byte, the most a Python object it can open costs (measured on
    CPython 3.11: a dict ~200 bytes, a list with its first element's share ~96 (the
    first element follows no comma: ``["Ā"]`` is a list of 80 and a string of 78), an
    element after a comma up to ~90 with its pointer, a key ~40, and a string's own
    object ~60 beyond its characters, 30 per quote). Bytes inside strings are counted
    as if they were structure too, so this over-counts prose; real Claude Code bodies cost
    2-4 times their size (see docs/reference/gateway.md), pathological ones
    (``[{},{},…]``) about 100 times.
    """
    kind = 4 if _WIDE4.search(body) else 2 if _WIDE2.search(body) else 1
    return (
        len(body) * (1 + kind)
        + 200 * body.count(b"{")
        + 96 * body.count(b"[")
        + 90 * body.count(b",")
        + 40 * body.count(b":")
        + 30 * body.count(b'"')
    )


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object; ValueError with the reason otherwise.

    NaN/Infinity are refused (not JSON), deep nesting is caught; duplicate keys
    keep the last value, and the gateway re-serialises what it forwards, so the
    upstream never sees a document that parses differently than it did here.
    A body whose parse could take more than ``COST_RATIO`` times its size (plus
    ``COST_SLACK``) is refused before parsing (:func:`json_cost`): the parser's
    peak memory stays a small multiple of the body, whatever its shape.
    """
    cost = json_cost(body)
    if cost > COST_RATIO * len(body) + COST_SLACK:
        raise ValueError(
            f"JSON structure too dense: parsing it could take {cost >> 20} MiB for a "
            f"{len(body) >> 10} KiB body; refused to bound the gateway's memory"
        )
    try:
        # json.loads(body, parse_constant=…) without its per-call decoder (and scanner).
        doc = _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"body must be a JSON object, not {type(doc).__name__}")
    return doc
