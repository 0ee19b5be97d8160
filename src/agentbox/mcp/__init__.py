"""The MCP delegation server: a host agent hands coding tasks to agentbox.

Tools ``delegate``, ``status``, ``result``, ``cancel``, ``list_tasks`` and
``models`` over stdio (``agentbox mcp``) or streamable HTTP on loopback with a
bearer token (``agentbox mcp --http 127.0.0.1:PORT``). The server runs
unprivileged: started as root it drops to an ordinary uid with no
capabilities, and talks to the launcher only through its unix socket.
"""

from agentbox.linux.privdrop import process_posture
from agentbox.mcp._auth import (
    GateMiddleware,
    check_bind,
    load_or_create_token,
    parse_listen,
    token_path,
)
from agentbox.mcp._fetch import branch_name, fetch_branch
from agentbox.mcp._privdrop import Identity, drop_privileges, resolve_identity
from agentbox.mcp._repo import validate_repo
from agentbox.mcp._run import (
    Prepared,
    claude_add_command,
    launcher_socket,
    mcp_url,
    prepare,
    run_http,
    run_stdio,
    serve,
)
from agentbox.mcp._server import ServerConfig, build_server

__all__ = [
    "GateMiddleware",
    "Identity",
    "Prepared",
    "ServerConfig",
    "branch_name",
    "build_server",
    "check_bind",
    "claude_add_command",
    "drop_privileges",
    "fetch_branch",
    "launcher_socket",
    "load_or_create_token",
    "mcp_url",
    "parse_listen",
    "prepare",
    "process_posture",
    "resolve_identity",
    "run_http",
    "run_stdio",
    "serve",
    "token_path",
    "validate_repo",
]
