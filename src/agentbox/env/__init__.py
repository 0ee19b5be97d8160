"""Environments: the setup phase and frozen environments.

A Boxfile's ``[setup]`` installs a project's dependencies before the agent
runs; what it creates in ``/workspace`` (``.venv/``, ``node_modules/`` …) is
frozen under a key (image id + setup commands + the contents of ``inputs``)
and mounted copy-on-write into every later task with the same key, which then
skips setup and never sees a proxy. Egress for a phase goes through the
per-task proxy of :mod:`agentbox.egress`, relayed to ``127.0.0.1:3128`` inside.

Public API::

    plan = prepare_env(settings, box, backend, task_id=…, task_root=…, workspace=…,
                       log_dir=…, labels=…, proxy_identity=…)
    plan.report          # SetupReport: hit | miss | failed, output tail, files, size, egress
    plan.mounts          # BindMounts for the agent's sandbox (/workspace/<dir>)
    plan.release()       # after the agent's sandbox is gone
    EnvStore(settings).list() / .remove(key) / .prune(older_than)
"""

from __future__ import annotations

from agentbox.env._brokered import brokered_rules, sandbox_config
from agentbox.env._committed import (
    COMMITTED_BOXFILE,
    check_env_policy,
    committed_boxfile,
    with_overrides,
)
from agentbox.env._egress import (
    CA_IN_SANDBOX,
    EGRESS_PORT,
    EGRESS_SOCKET_NAME,
    Egress,
    egress_argv,
    rule_secrets,
    start_egress,
)
from agentbox.env._key import env_key
from agentbox.env._model import EnvInfo, SetupReport
from agentbox.env._mount import EnvMount, walk_tree
from agentbox.env._phase import EnvPlan, image_id, prepare_env, setup_sandbox_name
from agentbox.env._report import release_task_env, report_fields, save_setup_report
from agentbox.env._store import EnvStore

__all__ = [
    "CA_IN_SANDBOX",
    "COMMITTED_BOXFILE",
    "EGRESS_PORT",
    "EGRESS_SOCKET_NAME",
    "Egress",
    "EnvInfo",
    "EnvMount",
    "EnvPlan",
    "EnvStore",
    "SetupReport",
    "brokered_rules",
    "check_env_policy",
    "committed_boxfile",
    "egress_argv",
    "env_key",
    "image_id",
    "prepare_env",
    "release_task_env",
    "report_fields",
    "rule_secrets",
    "sandbox_config",
    "save_setup_report",
    "setup_sandbox_name",
    "start_egress",
    "walk_tree",
    "with_overrides",
]
