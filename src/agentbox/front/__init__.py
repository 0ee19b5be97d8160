"""The resident front end: ``agentbox`` commands without Python's start-up.

A plain ``agentbox run`` spends half a second importing pydantic, typer, rich and
our own modules before its task is even recorded. The
launcher service (``agentbox launcher serve``) keeps a *fork server* beside it
(:mod:`agentbox.front.server`, kept by :mod:`agentbox.launcher._front`): one
process that imported all of that once, listens on ``<data_dir>/run/front.sock``
(0600, the service's uid only) and keeps a copy of itself forked ahead, which takes
the next connection and becomes the caller's command (a fresh copy is forked for the
one after).

The ``agentbox`` console script is :func:`agentbox.front.client.entry`: a
standard-library-only client that hands the server its argv, environment, working
directory and standard streams (the file descriptors themselves, over
``SCM_RIGHTS``), forwards its signals to the command and exits with its status.
Where no server answers, or the server declines, the command runs in the client's
own process exactly as before.

The forked command must be the command the caller would have run itself, with
nothing more. The server serves a caller only when it holds exactly the server's
own credentials (uids, gids, groups, every capability set, no-new-privs, seccomp,
LSM label, namespaces, root): a root process with fewer rights is declined and runs
its command itself. The forked command then takes on the caller's cgroups, nice
value, CPU affinity, OOM score adjustment, resource limits, umask, blocked and
ignored signals, environment, working directory and terminal
(:mod:`agentbox.front._child`); it dies with SIGKILL when the caller's connection
ends (a client killed with SIGKILL takes its command along, as a process would).

``AGENTBOX_FRONT_END``: ``auto`` (the default: use a server if one answers),
``off`` (never; the service starts none either) or ``require`` (fail instead of
running the command in-process: benchmarks and tests).
"""

from __future__ import annotations

from agentbox.core.frontend import ENV, SOCKET_NAME

__all__ = ["ENV", "SOCKET_NAME"]
