"""The host user's own registry and git credentials, as request rules the proxy injects.

A team's pip and npm already hold its credentials (pip's ``index-url`` with
``user:pass@``, ``~/.netrc``, the user's keyring (:mod:`._keyring`), ``PIP_INDEX_URL``;
npm's ``.npmrc`` ``//host/:_authToken=``, ``_auth``, ``username``/``_password``, scoped registries),
and its git remote has a credential helper. :func:`host_credentials` and
:func:`git_fetch` read them **as the submitting user** (a child process with that
user's uid, gid and no other groups: what the user can read, nothing more, so a
link from ``~/.netrc`` to a root-only file yields nothing) and turn each into a
:class:`~agentbox.egress.rules.NetworkRule` whose ``inject`` names a *brokered*
value (``${secret:AGENTBOX_HOST_PIP_1}``), with the value itself in
:attr:`Brokered.values`: it travels to the proxy with the task's resolved secrets
(through the proxy's secret pipe at spawn), never into a file, argv, env or log.

What the sandbox gets instead (:attr:`Brokered.env`, :attr:`Brokered.npmrc`) names the
same registries with no credential: ``PIP_INDEX_URL=https://pypi.corp.example/simple/``,
an npmrc with ``registry=`` lines and ``//host/:_authToken=agentbox-brokered`` (npm
wants a token to exist for a registry; the proxy replaces the header).

Brokered names start with :data:`RESERVED_PREFIX`; a Boxfile rule that names one is
refused (:func:`combine`): a repo could otherwise send the host's credential to a host
of its choosing.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from agentbox.config import Settings
from agentbox.core.hostname import normalize_host
from agentbox.core.log import get_logger
from agentbox.egress._keyring import keyring_credentials, keyring_env, owner_runner
from agentbox.egress.rules import PLACEHOLDER, Inject, NetworkRule, secret_names
from agentbox.errors import PolicyRefused

log = get_logger(__name__)

#: Names of brokered values; never resolvable from a Boxfile.
RESERVED_PREFIX = "AGENTBOX_"
#: What a refused push says (the deny rule's message).
GIT_REFUSE_MESSAGE = (
    "git push is refused in the sandbox: results are published from the host: "
    "agentbox publish ID --push"
)
_READ_TIMEOUT = 60.0


@dataclass(frozen=True)
class Brokered:
    """Rules with injected host credentials, their values, and the sandbox's clean config."""

    rules: tuple[NetworkRule, ...] = ()
    values: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Brokered name -> the header value to inject. For the proxy's secret pipe only."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables for the sandbox's clients: registries and remote, without credentials."""
    npmrc: str = ""
    """An npmrc for the sandbox (``npm_config_userconfig``), without credentials."""
    notes: tuple[str, ...] = ()
    """What was brokered, for the task log (host names and sources, never a value)."""

    def __add__(self, other: Brokered) -> Brokered:
        clash = set(self.values) & set(other.values)
        if clash:
            raise ValueError(f"brokered names used twice: {sorted(clash)}")
        return Brokered(
            rules=(*self.rules, *other.rules),
            values={**self.values, **other.values},
            env={**self.env, **other.env},
            npmrc=self.npmrc + other.npmrc,
            notes=(*self.notes, *other.notes),
        )

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts the rules name, in order, without repeats."""
        return tuple(dict.fromkeys(r.host for r in self.rules))


def combine(boxfile_rules: Sequence[NetworkRule], brokered: Brokered) -> tuple[NetworkRule, ...]:
    """The proxy's rules: the brokered ones' deny rules first, then the Boxfile's, then the rest.

    :class:`PolicyRefused` if a Boxfile rule names a brokered (reserved) value.
    """
    for rule in boxfile_rules:
        for name in secret_names([rule]):
            if name.startswith(RESERVED_PREFIX):
                raise PolicyRefused(
                    f"[[network.rule]] for {rule.host}: secret names starting with "
                    f"{RESERVED_PREFIX} are reserved for the host's own credentials"
                )
    denies = tuple(r for r in brokered.rules if r.deny)
    allows = tuple(r for r in brokered.rules if not r.deny)
    return (*denies, *boxfile_rules, *allows)


def strip_userinfo(url: str) -> str:
    """``url`` without ``user:pass@``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---------------------------------------------------------------- reading as the user

# Runs as the user, with only their rights: pip's config (through pip), netrc, npmrc files.
_READER = r"""
import json, os, subprocess, sys, shutil
out = {"pip": "", "netrc": {}, "npmrc": [], "npm_env": {}}
py = shutil.which("python3")
if py:
    try:
        r = subprocess.run([py, "-m", "pip", "config", "list"], capture_output=True,
                           text=True, timeout=50, stdin=subprocess.DEVNULL)
        out["pip"] = r.stdout
    except Exception:
        pass
home = os.path.expanduser("~")
try:
    import netrc
    n = netrc.netrc(os.environ.get("NETRC") or os.path.join(home, ".netrc"))
    for host, (login, _acct, password) in n.hosts.items():
        if login is not None and password is not None:
            out["netrc"][host] = [login, password]
except Exception:
    pass
files = [os.environ.get("NPM_CONFIG_USERCONFIG") or os.environ.get("npm_config_userconfig")
         or os.path.join(home, ".npmrc")]
npm = shutil.which("npm")
if npm:
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(npm)))
    files += [os.environ.get("NPM_CONFIG_GLOBALCONFIG") or os.path.join(prefix, "etc", "npmrc"),
              "/etc/npmrc"]
for f in dict.fromkeys(x for x in files if x):
    try:
        with open(f, encoding="utf-8") as fh:
            out["npmrc"].append(fh.read(1 << 20))
    except OSError:
        pass
for k, v in os.environ.items():
    if k.lower().startswith("npm_config_") and ("registry" in k.lower() or "auth" in k.lower()):
        out["npm_env"][k] = v
json.dump(out, sys.stdout)
"""

_PASS_ENV = (
    "PIP_", "NPM_CONFIG_", "npm_config_", "NETRC", "XDG_", "PIP_CONFIG_FILE",
    "PYTHON_KEYRING_BACKEND", "DBUS_SESSION_BUS_ADDRESS",
)  # fmt: skip


def _user_env(uid: int, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment the reader runs in."""
    try:
        pw = pwd.getpwuid(uid)
        home, name = pw.pw_dir, pw.pw_name
    except KeyError:  # a bare uid (no passwd entry): no home, no config files
        home, name = "/nonexistent", str(uid)
    base = {
        "HOME": home,
        "USER": name,
        "LOGNAME": name,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
    }
    if env is not None:
        # Only the caller's own environment (tests; root's launcher for root's tasks).
        for key, value in env.items():
            if key in ("PATH", "HOME") or key.startswith(_PASS_ENV):
                base[key] = value
    return base


def _run_as(
    uid: int,
    argv: list[str],
    env: dict[str, str],
    stdin: str = "",
    cwd: str = "/",
    timeout: float = _READ_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """``argv`` as ``uid`` (its primary group, no other groups) unless that is us."""
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    other = uid != os.geteuid()
    return subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        user=uid if other else None,
        group=gid if other else None,
        extra_groups=[] if other else None,
    )


def _read_user_config(uid: int, env: Mapping[str, str] | None) -> dict[str, object]:
    run_env = _user_env(uid, env)
    try:
        res = _run_as(uid, [sys.executable, "-I", "-c", _READER], run_env)
        data = json.loads(res.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        # Never the output: it may hold credentials.
        log.warning(
            "cannot read the user's registry configuration", uid=uid, error=type(exc).__name__
        )
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------- pip


def _pip_urls(text: str) -> tuple[list[str], list[str]]:
    """(index-url values, extra-index-url values) from ``pip config list`` output."""
    index: list[str] = []
    extra: list[str] = []
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        key = name.rsplit(".", 1)[-1].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        words = value.replace("\\n", " ").split()
        if key == "index-url":
            index = words  # later sources (env) win, as in pip
        elif key == "extra-index-url":
            extra.extend(words)
    return index, extra


def _registry_host(url: str) -> tuple[str, str, str | None, str | None] | None:
    """(host, url without credentials, user, password) of an https URL; None otherwise."""
    try:
        parts = urlsplit(url)
        host = normalize_host(parts.hostname or "")
    except ValueError:
        return None
    if parts.scheme != "https":
        return None
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return host, strip_userinfo(url), user, password


def _pip_keyring(
    uid: int, env: Mapping[str, str] | None, urls: Sequence[str], netrc: Mapping[str, object]
) -> dict[str, tuple[str, str]]:
    """What the user's keyring holds for the https index URLs that carry no password
    (and no ``~/.netrc`` entry): ``clean URL -> (user, password)``, asked as pip asks."""
    asks: list[tuple[str, str, str | None]] = []
    for url in urls:
        reg = _registry_host(url)
        if reg is None:
            continue
        host, clean, user, password = reg
        if password is not None or (user is None and host in netrc):
            continue
        asks.append((clean, urlsplit(clean).netloc, user))
    if not asks:
        return {}
    run_env = keyring_env(uid, _user_env(uid, env))
    return keyring_credentials(asks, run_env, owner_runner(uid, _run_as))


# ---------------------------------------------------------------- npm


def _npmrc_lines(texts: Iterable[str], env: Mapping[str, str]) -> dict[str, str]:
    """``key -> value`` of npmrc files (first file wins, as npm's user config does), ``${VAR}``
    expanded from ``env``; a value naming an unset variable is dropped."""
    out: dict[str, str] = {}
    for text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;" or "=" not in line:
                continue
            key, _, value = line.partition("=")
            key, value = key.strip(), value.strip().strip("'\"")
            if "${" in value:
                try:
                    value = _expand_env(value, env)
                except KeyError:
                    continue
            out.setdefault(key, value)
    return out


def _expand_env(value: str, env: Mapping[str, str]) -> str:
    out, rest = "", value
    while "${" in rest:
        head, _, tail = rest.partition("${")
        name, sep, rest = tail.partition("}")
        if not sep:
            raise KeyError(name)
        out += head + env[name]
    return out + rest


def _npm_rules(
    conf: Mapping[str, str], start: int
) -> tuple[list[NetworkRule], dict[str, str], str, list[str]]:
    """Rules, values, sandbox npmrc and notes from npm's config keys."""
    rules: list[NetworkRule] = []
    values: dict[str, str] = {}
    lines: list[str] = []
    notes: list[str] = []
    registries = {k: v for k, v in conf.items() if k == "registry" or k.endswith(":registry")}
    for key, url in registries.items():
        if (reg := _registry_host(url)) is not None:
            lines.append(f"{key}={reg[1]}")
    # Credentials are keyed by "//host[:port]/path/:" (npm's nerf-dart).
    creds: dict[str, dict[str, str]] = {}
    for key, value in conf.items():
        if key.startswith("//") and ":" in key[2:]:
            where, _, what = key[2:].rpartition(":")
            creds.setdefault(where, {})[what] = value
    n = start
    for where, fields in creds.items():
        host_part, _, path = where.partition("/")
        try:
            host = normalize_host(host_part.split(":", 1)[0])
        except ValueError:
            continue
        if "_authToken" in fields:
            value = f"Bearer {fields['_authToken']}"
        elif "_auth" in fields:
            value = f"Basic {fields['_auth']}"
        elif "username" in fields and "_password" in fields:
            try:
                password = base64.b64decode(fields["_password"]).decode()
            except ValueError:
                continue
            value = _basic(fields["username"], password)
        else:
            continue
        name = f"{RESERVED_PREFIX}HOST_NPM_{n}"
        n += 1
        values[name] = value
        prefix = "/" + path.rstrip("/")
        rules.append(
            NetworkRule(
                host=host,
                methods=("GET", "HEAD"),
                paths=(f"{prefix}/*" if prefix != "/" else "/*",),
                inject=Inject("Authorization", f"${{secret:{name}}}"),
                phases=frozenset({"setup"}),
                origin="host-npm",
            )
        )
        lines.append(f"//{where}:_authToken={PLACEHOLDER}")
        notes.append(f"npm registry {host}: the host's npm credential is brokered (setup only)")
    return rules, values, "".join(f"{x}\n" for x in lines), notes


# ---------------------------------------------------------------- public


def host_credentials(
    uid: int,
    *,
    env: Mapping[str, str] | None = None,
    phases: frozenset[str] = frozenset({"setup"}),
) -> Brokered:
    """The user ``uid``'s pip and npm credentials as rules (read as that user).

    ``env``: variables of the user's own session to honour (``PIP_INDEX_URL``,
    ``npm_config_*``, ``NETRC``…); the launcher passes its own only for root's tasks.
    """
    data = _read_user_config(uid, env)
    rules: list[NetworkRule] = []
    values: dict[str, str] = {}
    sandbox_env: dict[str, str] = {}
    notes: list[str] = []
    netrc = data.get("netrc") or {}
    assert isinstance(netrc, dict)
    index, extra = _pip_urls(str(data.get("pip") or ""))
    clean_index: list[str] = []
    clean_extra: list[str] = []
    n = 1
    seen: set[str] = set()
    from_keyring = _pip_keyring(uid, env, index + extra, netrc)
    for which, urls in (("index", index), ("extra", extra)):
        for url in urls:
            reg = _registry_host(url)
            if reg is None:
                continue
            host, clean, user, password = reg
            (clean_index if which == "index" else clean_extra).append(clean)
            origin, source = "host-pip", "pip config"
            if user is None and host in netrc:
                user, password = netrc[host]
                origin, source = "host-netrc", "~/.netrc"
            if password is None and clean in from_keyring:
                user, password = from_keyring[clean]
                origin, source = "host-keyring", "the user's keyring"
            if user is None or host in seen:
                continue
            seen.add(host)
            name = f"{RESERVED_PREFIX}HOST_PIP_{n}"
            n += 1
            values[name] = _basic(user, password or "")
            rules.append(
                NetworkRule(
                    host=host,
                    methods=("GET", "HEAD"),
                    paths=("/*",),
                    inject=Inject("Authorization", f"${{secret:{name}}}"),
                    phases=phases,
                    origin=origin,
                )
            )
            notes.append(f"pip index {host}: the credential from {source} is brokered")
    if clean_index:
        sandbox_env["PIP_INDEX_URL"] = clean_index[0]
    if clean_extra:
        sandbox_env["PIP_EXTRA_INDEX_URL"] = " ".join(clean_extra)
    raw_npmrc = data.get("npmrc")
    npm_texts = [t for t in raw_npmrc if isinstance(t, str)] if isinstance(raw_npmrc, list) else []
    npm_env = data.get("npm_env") or {}
    assert isinstance(npm_env, dict)
    conf = _npmrc_lines(npm_texts, {**(env or {})})
    for key, value in npm_env.items():
        k = str(key)[len("npm_config_") :]
        conf.setdefault(k, str(value))
    npm_rules, npm_values, npmrc, npm_notes = _npm_rules(conf, 1)
    npm_rules = [replace(r, phases=phases) for r in npm_rules]
    return Brokered(
        rules=(*rules, *npm_rules),
        values={**values, **npm_values},
        env=sandbox_env,
        npmrc=npmrc,
        notes=(*notes, *npm_notes),
    )


def _remote_url(
    repo: Path, uid: int, remote: str, user_env: Mapping[str, str] | None
) -> str | None:
    env = _user_env(uid, user_env)
    env["GIT_TERMINAL_PROMPT"] = "0"
    git = shutil.which("git", path=env["PATH"]) or "git"
    res = _run_as(
        uid,
        [git, "-c", f"safe.directory={repo}", "-C", str(repo), "config", "--get",
         f"remote.{remote}.url"],
        env,
    )  # fmt: skip
    url = res.stdout.strip()
    return url or None


def _credential_fill(
    uid: int, host: str, path: str, user_env: Mapping[str, str] | None
) -> tuple[str, str] | None:
    """(username, password) from the user's git credential helpers, asked as that user."""
    env = _user_env(uid, user_env)
    env.update({
        "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false",
    })  # fmt: skip
    git = shutil.which("git", path=env["PATH"]) or "git"
    request = f"protocol=https\nhost={host}\npath={path.lstrip('/')}\n\n"
    try:
        res = _run_as(uid, [git, "credential", "fill"], env, stdin=request)
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("git credential fill failed", error=type(exc).__name__)
        return None
    if res.returncode != 0:
        return None
    got = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    if "password" not in got:
        return None
    return got.get("username", ""), got["password"]


def git_fetch_rules(host: str, path: str, inject: Inject | None) -> tuple[NetworkRule, ...]:
    """The agent phase's rules for ``[git] fetch`` of ``https://host/path``: the smart-HTTP
    upload-pack requests, with ``inject``; receive-pack (a push), refused with
    :data:`GIT_REFUSE_MESSAGE`. The escape suite's push probe uses these very rules."""
    agent = frozenset({"agent"})
    return (
        NetworkRule(
            host=host, methods=("GET", "HEAD"),
            paths=(f"{path}/info/refs",), phases=agent,
            refuse_message=GIT_REFUSE_MESSAGE, origin="git-fetch", query="service=git-receive-pack",
        ),
        NetworkRule(
            host=host, methods=("POST",), paths=(f"{path}/git-receive-pack",), phases=agent,
            refuse_message=GIT_REFUSE_MESSAGE, origin="git-fetch",
        ),
        NetworkRule(
            host=host, methods=("GET",), paths=(f"{path}/info/refs",), inject=inject,
            phases=agent, origin="git-fetch", query="service=git-upload-pack",
        ),
        NetworkRule(
            host=host, methods=("POST",), paths=(f"{path}/git-upload-pack",), inject=inject,
            phases=agent, origin="git-fetch",
        ),
    )  # fmt: skip


def git_fetch(
    repo: Path,
    uid: int,
    *,
    remote: str = "origin",
    secret: tuple[str, str] | None = None,
    proxy_url: str = "http://127.0.0.1:3128",
    ca_path: str = "/run/agentbox/ca/ca.pem",
    env: Mapping[str, str] | None = None,
) -> Brokered:
    """Rules that let the agent fetch (never push) ``repo``'s https ``remote``.

    The credential: ``secret`` (user, password) if given (the Boxfile's
    ``[git] secret``, resolved by the caller), else the URL's own ``user:pass@``, else
    the user's git credential helpers (``git credential fill`` as ``uid``); with none
    the rules still allow upload-pack (a public remote). :class:`PolicyRefused` if the
    remote is missing or not https.

    :attr:`Brokered.env` configures git in the sandbox (``GIT_CONFIG_*``): the remote's
    URL without credentials, ``http.proxy`` and ``http.sslCAInfo``.
    """
    url = _remote_url(repo, uid, remote, env)
    if url is None:
        raise PolicyRefused(f"[git] fetch: the repo has no remote {remote!r}")
    reg = _registry_host(url)
    if reg is None:
        raise PolicyRefused(
            f"[git] fetch: remote {remote!r} is not an https URL "
            f"({strip_userinfo(url)[:120]}): only https remotes can be fetched through the proxy"
        )
    host, clean, user, password = reg
    path = urlsplit(clean).path.rstrip("/") or "/"
    cred: tuple[str, str] | None
    source = ""
    if secret is not None:
        cred, source = secret, "agentbox secret"
    elif user is not None:
        cred, source = (user, password or ""), "the remote's URL"
    else:
        cred = _credential_fill(uid, host, path, env)
        source = "the user's git credential helper"
    values: dict[str, str] = {}
    inject = None
    if cred is not None:
        name = f"{RESERVED_PREFIX}GIT_FETCH"
        values[name] = _basic(*cred)
        inject = Inject("Authorization", f"${{secret:{name}}}")
    rules = git_fetch_rules(host, path, inject)
    config = {
        f"remote.{remote}.url": clean,
        f"remote.{remote}.fetch": f"+refs/heads/*:refs/remotes/{remote}/*",
        "http.proxy": proxy_url,
        "http.sslCAInfo": ca_path,
    }
    git_env = {"GIT_CONFIG_COUNT": str(len(config))}
    for i, (k, v) in enumerate(config.items()):
        git_env[f"GIT_CONFIG_KEY_{i}"] = k
        git_env[f"GIT_CONFIG_VALUE_{i}"] = v
    note = f"git fetch from {host}{path}"
    note += f": the credential from {source} is brokered" if cred else ": no credential found"
    return Brokered(rules=rules, values=values, env=git_env, notes=(note,))


def brokered_for_phase(
    settings: Settings,
    *,
    phase: str,
    uid: int | None,
    repo: Path | None,
    registries: bool,
    git_remote: str | None,
    git_secret: str | None = None,
    git_user: str = "x-access-token",
    proxy_url: str,
    ca_path: str,
) -> Brokered:
    """What the host brokers for one phase of a task submitted by ``uid``.

    Setup with ``registries`` (``[setup] network = "registries"``): the user's pip/npm
    credentials (:func:`host_credentials`; the launcher's own environment counts only
    for root's tasks). The agent phase with ``git_remote`` (``[git] fetch``'s remote):
    :func:`git_fetch` on ``repo``, the credential from the secret ``git_secret``
    (resolved for ``uid``, sent as the password of ``git_user``) if named.
    """
    owner = os.geteuid() if uid is None else uid
    own_env = os.environ if owner == os.geteuid() else None
    out = Brokered()
    if phase == "setup" and registries:
        out = out + host_credentials(owner, env=own_env)
    if phase == "agent" and git_remote is not None:
        if repo is None:
            raise PolicyRefused("[git] fetch needs the task's repo")
        secret = None
        if git_secret is not None:
            from agentbox.secrets import SecretStore

            value = SecretStore(settings).resolve([git_secret], owner)[git_secret]
            secret = (git_user, value)
        out = out + git_fetch(
            repo, owner, remote=git_remote, secret=secret, proxy_url=proxy_url,
            ca_path=ca_path, env=own_env,
        )  # fmt: skip
    return out
