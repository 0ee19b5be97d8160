"""Local forge API servers for the pull-request tests: every request checked against the
forge's published API description.

There is no GitHub or GitLab to run here, so the clients (PyGithub, python-gitlab) talk
to a small HTTP server on 127.0.0.1 that keeps a repo's state (its default branch, its
open pull requests) and **validates each request** before it answers:

* GitHub: against GitHub's own OpenAPI description (``@octokit/openapi`` from npm,
  ``generated/api.github.com.json``, installed by ``scripts/setup.sh``) with
  ``openapi-core``: the path and method must be an operation of the description, the
  path and query parameters and the JSON body must match its schemas, and a body may
  hold no property the description does not name (``additionalProperties: false`` is
  added to the request bodies, so a misspelt field fails instead of being ignored).
  Answers are the description's own examples (adjusted: number, branch, URL), and each
  is validated against the response schema too, so the client parses what GitHub sends.
* GitLab: GitLab publishes no OpenAPI description of the merge-request API on PyPI or
  npm (its repository's ``doc/api/openapi/openapi_v2.yaml`` covers other endpoints and
  is not packaged), so requests are checked against the documented fields, cited:
  https://docs.gitlab.com/api/projects/#get-a-single-project and
  https://docs.gitlab.com/api/merge_requests/#create-mr /
  https://docs.gitlab.com/api/merge_requests/#list-project-merge-requests.

A request that fails its check is answered 400 (unknown operation: 404) and recorded in
``errors``; tests assert ``errors == []`` and read ``requests``.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
GITHUB_DESCRIPTION = (
    ROOT / ".venv/share/octokit-openapi/node_modules/@octokit/openapi/generated/api.github.com.json"
)
#: The GitHub operations the client may call (path template, method).
GITHUB_OPS = {
    ("/repos/{owner}/{repo}", "get"),
    ("/repos/{owner}/{repo}/pulls", "get"),
    ("/repos/{owner}/{repo}/pulls", "post"),
}


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _resolve(spec: dict[str, Any], ref: str) -> Any:
    node: Any = spec
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


@cache
def github_description() -> dict[str, Any]:
    """The used operations of GitHub's OpenAPI description, with every component they
    reach (a slice: the whole description takes minutes to load into openapi-core)."""
    if not GITHUB_DESCRIPTION.is_file():
        raise AssertionError(
            f"{GITHUB_DESCRIPTION} is missing: scripts/setup.sh installs @octokit/openapi"
        )
    full = json.loads(GITHUB_DESCRIPTION.read_text())
    paths: dict[str, Any] = {}
    for path, method in GITHUB_OPS:
        item = paths.setdefault(path, {})
        op = copy.deepcopy(full["paths"][path][method])
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
        if "schema" in body:
            body["schema"]["additionalProperties"] = False
        item[method] = op
    sliced: dict[str, Any] = {k: v for k, v in full.items() if k not in ("paths", "components")}
    sliced["paths"] = paths
    sliced["components"] = {}
    todo = list(_refs(paths))
    seen: set[str] = set()
    while todo:
        ref = todo.pop()
        if ref in seen or not ref.startswith("#/components/"):
            continue
        seen.add(ref)
        _, _, kind, name = ref.split("/", 3)
        node = _resolve(full, ref)
        sliced["components"].setdefault(kind, {})[name] = node
        todo.extend(_refs(node))
    return sliced


@cache
def _github_openapi() -> Any:
    from openapi_core import Config, OpenAPI

    # The description is GitHub's own and sliced faithfully: not re-validated (minutes).
    return OpenAPI.from_dict(github_description(), config=Config(spec_validator_cls=None))


def _example(name: str) -> Any:
    value = copy.deepcopy(_resolve(github_description(), f"#/components/examples/{name}")["value"])
    _fill_language(value)
    return value


def _fill_language(node: Any) -> None:
    """GitHub's own examples break their schemas in two places: ``language`` (required,
    nullable) is left out of some repos, ``type`` out of the requested teams (none here)."""
    if isinstance(node, dict):
        if "full_name" in node and "clone_url" in node:
            node.setdefault("language", None)
        if "requested_teams" in node:
            node["requested_teams"] = []
        for v in node.values():
            _fill_language(v)
    elif isinstance(node, list):
        for v in node:
            _fill_language(v)


@dataclass
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class ForgeServer:
    """A forge API on 127.0.0.1 (``kind``: github | gitlab) holding one repo's state."""

    kind: str
    repo: str = "octo/hello"
    default_branch: str = "main"
    requests: list[Seen] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pulls: list[dict[str, Any]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> ForgeServer:
        if self.kind == "github":
            _github_openapi()  # built before the first request (seconds)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _any(self) -> None:
                owner._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- handling ----------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        ctype = h.headers.get("Content-Type", "")
        body: Any = None
        if raw:
            try:
                body = json.loads(raw) if "json" in ctype else parse_qs(raw.decode())
            except ValueError:
                body = raw.decode(errors="replace")
        seen = Seen(h.command, unquote(parts.path), parse_qs(parts.query),
                    {k.lower(): v for k, v in h.headers.items()}, body)  # fmt: skip
        self.requests.append(seen)
        try:
            if self.kind == "github":
                status, answer = self._github(h, parts.path, parts.query, raw, ctype, seen)
            else:
                status, answer = self._gitlab(seen)
        except _Refused as exc:
            self.errors.append(f"{h.command} {h.path}: {exc.message}")
            status, answer = exc.status, {"message": exc.message}
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _github(self, h: BaseHTTPRequestHandler, path: str, query: str, raw: bytes,
                ctype: str, seen: Seen) -> tuple[int, Any]:  # fmt: skip
        from openapi_core.templating.paths.exceptions import PathNotFound, PathsNotFound
        from openapi_core.testing import MockRequest, MockResponse

        api = _github_openapi()
        args = {k: v[-1] for k, v in seen.query.items()}
        req = MockRequest("https://api.github.com", h.command.lower(), path, args=args,
                          data=raw or None, headers=dict(h.headers.items()),
                          content_type=ctype.split(";")[0] or None)  # fmt: skip
        try:
            api.validate_request(req)
        except (PathNotFound, PathsNotFound) as exc:
            raise _Refused(404, f"not an operation of GitHub's API description: {exc}") from exc
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc} {getattr(exc, '__cause__', '')}"
            raise _Refused(400, why) from exc
        if not seen.headers.get("authorization", "").startswith(("token ", "Bearer ")):
            raise _Refused(401, "no token")
        owner_repo = "/".join(path.split("/")[2:4])
        if owner_repo != self.repo:
            raise _Refused(404, "Not Found")
        status, answer = self._github_answer(h.command, path, seen)
        # The examples' API links point at api.github.com and octocat/Hello-World; the
        # client follows them (and checks their host), so they name this server and repo.
        text = json.dumps(answer).replace("https://api.github.com", self.url)
        answer = json.loads(text.replace("octocat/Hello-World", self.repo))
        resp = MockResponse(json.dumps(answer).encode(), status_code=status,
                            content_type="application/json")  # fmt: skip
        try:
            api.validate_response(req, resp)
        except Exception as exc:  # the fake's own answer: a bug of the test server
            why = f"{exc} {getattr(exc, '__cause__', '')}"
            self.errors.append(f"the test server's answer is not GitHub's: {why[-600:]}")
        return status, answer

    def _github_answer(self, method: str, path: str, seen: Seen) -> tuple[int, Any]:
        if path.endswith("/pulls") and method == "POST":
            body = seen.body
            pr = _example("pull-request")
            number = 1347 + len(self.pulls)
            pr.update(number=number, title=body["title"], body=body.get("body"),
                      draft=bool(body.get("draft")), state="open",
                      html_url=f"https://github.com/{self.repo}/pull/{number}")  # fmt: skip
            pr["head"]["ref"] = body["head"]
            pr["base"]["ref"] = body["base"]
            self.pulls.append(pr)
            return 201, pr
        if path.endswith("/pulls"):
            head = seen.query.get("head", [""])[-1]
            base = seen.query.get("base", [""])[-1]
            items = []
            for pr in self.pulls:
                if head and f"{self.repo.split('/')[0]}:{pr['head']['ref']}" != head:
                    continue
                if base and pr["base"]["ref"] != base:
                    continue
                simple = _example("pull-request-simple-items")[0]
                simple.update(number=pr["number"], html_url=pr["html_url"], title=pr["title"])
                simple["head"]["ref"], simple["base"]["ref"] = pr["head"]["ref"], pr["base"]["ref"]
                items.append(simple)
            return 200, items
        repo = _example("full-repository-default-response")
        repo["default_branch"] = self.default_branch
        repo["full_name"] = self.repo
        return 200, repo

    def _gitlab(self, seen: Seen) -> tuple[int, Any]:
        if not seen.headers.get("private-token"):
            raise _Refused(401, "401 Unauthorized")
        prefix = "/api/v4/projects/"
        if not seen.path.startswith(prefix):
            raise _Refused(404, f"not a GitLab API path this test knows: {seen.path}")
        rest = seen.path.removeprefix(prefix)
        project, _, sub = rest.partition("/merge_requests")
        if project not in (self.repo, "3"):  # by path, or by the id the project answer gave
            raise _Refused(404, "404 Project Not Found")
        base = f"https://gitlab.example/{self.repo}"
        if seen.method == "GET" and not _ and not sub:
            _check(GITLAB_GET_PROJECT_QUERY, {k: v[-1] for k, v in seen.query.items()})
            return 200, {"id": 3, "path_with_namespace": self.repo, "web_url": base,
                         "default_branch": self.default_branch}  # fmt: skip
        if seen.method == "GET" and _ and not sub:
            query = {k: v[-1] for k, v in seen.query.items()}
            _check(GITLAB_LIST_MRS_QUERY, query)
            return 200, [m for m in self.pulls
                         if m["source_branch"] == query.get("source_branch", m["source_branch"])
                         and m["target_branch"] == query.get("target_branch", m["target_branch"])
                         and query.get("state", "opened") == "opened"]  # fmt: skip
        if seen.method == "POST" and _ and not sub:
            _check(GITLAB_CREATE_MR, seen.body)
            iid = 1 + len(self.pulls)
            mr = dict(seen.body, id=100 + iid, iid=iid, project_id=3, state="opened",
                      web_url=f"{base}/-/merge_requests/{iid}",
                      draft=str(seen.body["title"]).startswith("Draft:"))  # fmt: skip
            self.pulls.append(mr)
            return 201, mr
        raise _Refused(404, f"not a GitLab operation this test knows: {seen.method} {seen.path}")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _check(schema: dict[str, Any], value: Any) -> None:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        raise _Refused(400, f"400 Bad request - {exc.message}") from exc


_BOOLISH = {"type": "string", "enum": ["true", "false"]}
#: GET /projects/:id, https://docs.gitlab.com/api/projects/#get-a-single-project
GITLAB_GET_PROJECT_QUERY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"license": _BOOLISH, "statistics": _BOOLISH, "with_custom_attributes": _BOOLISH},
}
#: GET /projects/:id/merge_requests (the attributes used here and their documented values),
#: https://docs.gitlab.com/api/merge_requests/#list-project-merge-requests
GITLAB_LIST_MRS_QUERY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "state": {"enum": ["opened", "closed", "locked", "merged", "all"]},
        "source_branch": {"type": "string", "minLength": 1},
        "target_branch": {"type": "string", "minLength": 1},
        "page": {"type": "string", "pattern": "^[0-9]+$"},
        "per_page": {"type": "string", "pattern": "^[0-9]+$"},
    },
}
#: POST /projects/:id/merge_requests, https://docs.gitlab.com/api/merge_requests/#create-mr:
#: source_branch, target_branch and title required; these optional ones documented.
GITLAB_CREATE_MR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["source_branch", "target_branch", "title"],
    "properties": {
        "source_branch": {"type": "string", "minLength": 1},
        "target_branch": {"type": "string", "minLength": 1},
        "title": {"type": "string", "minLength": 1, "maxLength": 255},
        "description": {"type": "string", "maxLength": 1_048_576},
        "assignee_id": {"type": "integer"},
        "assignee_ids": {"type": "array", "items": {"type": "integer"}},
        "reviewer_ids": {"type": "array", "items": {"type": "integer"}},
        "labels": {"type": "string"},
        "milestone_id": {"type": "integer"},
        "remove_source_branch": {"type": "boolean"},
        "squash": {"type": "boolean"},
        "allow_collaboration": {"type": "boolean"},
        "target_project_id": {"type": "integer"},
    },
}
