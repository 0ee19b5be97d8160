"""The backend contract suite on the docker backend, under runc and runsc (gVisor).

The same test functions as tests/integration/test_backend_contract.py, with the
``case`` fixture giving a :class:`~agentbox.backends.docker.DockerBackend`. Its
sandboxes go through the shared ``sandboxes`` and ``live`` fixtures, i.e. the leak
guard (``sandbox_factory``, a module ``SandboxTracker``): none may leave a container,
process, cgroup or socket behind.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_backend_contract import (  # the shared contract: the same functions, our backend
    Case,
    gateway_dir,
    live,
    sandboxes,
    test_copy_out_never_follows_links_out,
    test_copy_roundtrip,
    test_destroy_is_idempotent,
    test_exec_env_stdin_and_workdir,
    test_exec_timeout,
    test_gateway_reachable_from_exec,
    test_gateway_reachable_from_run,
    test_posture_is_ok,
    test_run_deadline_kills_and_says_so,
    test_run_exit_code_and_separate_streams,
    test_run_stdin,
    test_run_streams_to_callbacks,
)

from agentbox.backends import get_backend
from agentbox.config import Settings

pytestmark = pytest.mark.docker

__all__ = [
    "gateway_dir",
    "live",
    "sandboxes",
    "test_copy_out_never_follows_links_out",
    "test_copy_roundtrip",
    "test_destroy_is_idempotent",
    "test_exec_env_stdin_and_workdir",
    "test_exec_timeout",
    "test_gateway_reachable_from_exec",
    "test_gateway_reachable_from_run",
    "test_posture_is_ok",
    "test_run_deadline_kills_and_says_so",
    "test_run_exit_code_and_separate_streams",
    "test_run_stdin",
    "test_run_streams_to_callbacks",
]


@pytest.fixture(scope="module", params=["runc", "runsc"], ids=["docker-runc", "docker-runsc"])
def case(
    request: pytest.FixtureRequest,
    default_image: str,
    settings_factory: Callable[[], Settings],
) -> Case:
    settings = settings_factory()
    return Case(get_backend("docker", settings), settings, request.param)
