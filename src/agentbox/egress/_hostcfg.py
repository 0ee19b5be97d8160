"""The package indexes this host's own clients use, read from those clients at run time.

No registry name is written in agentbox: what the user's pip, npm and uv already
trust is the allow-list of a ``registries`` phase. Read here:

- **pip** (the ``python3`` on ``PATH``): ``python3 -m pip config list`` (files and
  ``PIP_*`` variables) for ``index-url``, ``extra-index-url`` and http(s)
  ``find-links``; when no ``index-url`` is configured, pip's own default index and
  the domain that index serves files from, asked of pip itself
  (``pip._internal.models.index.PyPI``);
- **npm**: ``npm config list --json``: ``registry`` and every ``@scope:registry``;
- **uv**: ``UV_DEFAULT_INDEX``, ``UV_INDEX_URL``, ``UV_INDEX``, ``UV_EXTRA_INDEX_URL``.

Only ``http``/``https`` URLs count (``file://`` indexes and plain paths are local).
A client that is not installed contributes nothing.

Asking the clients costs a second or more (several under load), so the answer is
cached in the process for :data:`CACHE_TTL` seconds, keyed by what changes it
(:func:`client_fingerprint`): the clients' config files (path, size, mtime and
content), the binaries found on ``PATH`` (path, target, size, mtime) and every
environment variable that steers them (``PIP_*``, ``npm_config_*``, ``UV_*``,
``PYENV*``, ``XDG_*``, ``HOME``, ``PATH``, ``VIRTUAL_ENV`` …). A change to any of
them is a miss; the TTL bounds what the key cannot see (a pip upgrade in a
pyenv version chosen by a file).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from agentbox.core import proc as _proc
from agentbox.core.hostname import normalize_host
from agentbox.core.log import get_logger
from agentbox.errors import CommandError

log = get_logger(__name__)

#: (source, scheme, host, port) of one configured index.
RegistryURL = tuple[str, str, str, int]

_PIP_KEYS = ("index-url", "extra-index-url", "find-links")
_PIP_DEFAULT = (
    "from pip._internal.models.index import PyPI\nprint(PyPI.url)\nprint(PyPI.file_storage_domain)"
)
_UV_VARS = ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_INDEX", "UV_EXTRA_INDEX_URL")


def _parse_url(source: str, url: str) -> RegistryURL | None:
    """(source, scheme, host, port) of an http(s) URL, None for anything else."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        host = normalize_host(parts.hostname)
    except ValueError:
        log.warning("registry URL with no usable host name ignored", source=source, url=url[:200])
        return None
    return source, parts.scheme, host, port or (443 if parts.scheme == "https" else 80)


def _pip_config_values(text: str) -> tuple[list[str], bool]:
    """URLs from ``pip config list`` output, and whether an ``index-url`` is set."""
    urls: list[str] = []
    has_index = False
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        key = name.rsplit(".", 1)[-1].strip()
        if key not in _PIP_KEYS:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        # pip prints a multi-line value with escaped newlines.
        words = value.replace("\\n", " ").split()
        if key == "index-url" and words:
            has_index = True
        urls.extend(words)
    return urls, has_index


def _pip(env: Mapping[str, str]) -> list[RegistryURL]:
    python = shutil.which("python3", path=env.get("PATH"))
    if python is None:
        return []
    try:
        res = _proc.run([python, "-m", "pip", "config", "list"], env=env, timeout=60)
    except CommandError as exc:
        log.info("pip not usable on this host: no pip registries", error=str(exc)[:300])
        return []
    urls, has_index = _pip_config_values(res.stdout)
    found = [u for url in urls if (u := _parse_url("pip", url)) is not None]
    if not has_index:
        try:
            default = _proc.run([python, "-c", _PIP_DEFAULT], env=env, timeout=60).stdout.split()
        except CommandError as exc:
            log.warning("cannot read pip's default index", error=str(exc)[:300])
            default = []
        if default and (u := _parse_url("pip", default[0])) is not None:
            found.append(u)
            if len(default) > 1:
                # Files of the default index are served from another domain, over https.
                found.extend(
                    f for f in [_parse_url("pip", f"https://{default[1]}/")] if f is not None
                )
    return found


def _npm(env: Mapping[str, str]) -> list[RegistryURL]:
    npm = shutil.which("npm", path=env.get("PATH"))
    if npm is None:
        return []
    try:
        res = _proc.run([npm, "config", "list", "--json"], env=env, timeout=60)
        data = json.loads(res.stdout)
    except (CommandError, ValueError) as exc:
        log.info("npm config not readable: no npm registries", error=str(exc)[:300])
        return []
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        named = isinstance(key, str) and (key == "registry" or key.endswith(":registry"))
        if named and isinstance(value, str) and (u := _parse_url("npm", value)) is not None:
            found.append(u)
    return found


def _uv(env: Mapping[str, str]) -> list[RegistryURL]:
    found = []
    for var in _UV_VARS:
        for word in env.get(var, "").split():
            # UV_INDEX entries may be ``name=url``.
            url = word.split("=", 1)[1] if "=" in word.split("://", 1)[0] else word
            if (u := _parse_url("uv", url)) is not None:
                found.append(u)
    return found


def _dedupe(urls: Iterable[RegistryURL]) -> tuple[RegistryURL, ...]:
    return tuple(dict.fromkeys(urls))


#: Seconds a discovery answer is reused (with an unchanged :func:`client_fingerprint`).
CACHE_TTL = 600.0
#: Environment variables (exact names, then prefixes) that change what the clients say.
_ENV_NAMES = frozenset({
    "HOME", "PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME",
    "PYTHONNOUSERSITE", "PREFIX",
})  # fmt: skip
_ENV_PREFIXES = ("PIP_", "NPM_CONFIG_", "UV_", "PYENV", "XDG_")
#: Config files looked at for each client, besides those named by variables.
_MAX_CONFIG = 1 << 20
_cache: dict[str, tuple[float, tuple[RegistryURL, ...]]] = {}
_cache_lock = threading.Lock()


def _config_files(env: Mapping[str, str]) -> list[str]:
    home = env.get("HOME", "")
    xdg_home = env.get("XDG_CONFIG_HOME") or (f"{home}/.config" if home else "")
    xdg_dirs = (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":")
    files = [f"{d}/pip/pip.conf" for d in xdg_dirs if d]
    files += ["/etc/pip.conf", "/etc/npmrc", "/usr/etc/npmrc", f"{Path.cwd()}/.npmrc"]
    if home:
        files += [f"{home}/.pip/pip.conf", f"{home}/.npmrc"]
    if xdg_home:
        files.append(f"{xdg_home}/pip/pip.conf")
    if venv := env.get("VIRTUAL_ENV"):
        files.append(f"{venv}/pip.conf")
    for key, value in env.items():
        upper = key.upper()
        if upper in ("PIP_CONFIG_FILE", "NPM_CONFIG_USERCONFIG", "NPM_CONFIG_GLOBALCONFIG"):
            files.append(value)
    for tool in ("python3", "npm"):
        if (found := shutil.which(tool, path=env.get("PATH"))) is not None:
            # pip's site config and npm's builtin npmrc live next to the install.
            prefix = Path(found).resolve().parent.parent
            files += [f"{prefix}/pip.conf", f"{prefix}/npmrc"]
    return files


def _stamp_file(h: hashlib._Hash, path: str) -> None:
    h.update(b"\0file\0" + os.fsencode(path))
    p = Path(path)
    try:
        st = p.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
        if p.is_file() and st.st_size <= _MAX_CONFIG:
            h.update(hashlib.sha256(p.read_bytes()).digest())
    except OSError as exc:
        h.update(f"missing:{exc.errno}".encode())


def client_fingerprint(env: Mapping[str, str]) -> str:
    """A digest of everything :func:`host_registries` depends on that can be seen cheaply."""
    h = hashlib.sha256()
    for key in sorted(env):
        if key in _ENV_NAMES or key.upper().startswith(_ENV_PREFIXES):
            h.update(f"\0env\0{key}={env[key]}".encode(errors="surrogateescape"))
    for tool in ("python3", "npm"):
        found = shutil.which(tool, path=env.get("PATH"))
        h.update(f"\0bin\0{tool}={found}".encode())
        if found is not None:
            _stamp_file(h, str(Path(found).resolve()))
    for path in dict.fromkeys(_config_files(env)):
        _stamp_file(h, path)
    return h.hexdigest()


def host_registries(
    env: Mapping[str, str] | None = None, *, cache: bool = True
) -> tuple[RegistryURL, ...]:
    """Every http(s) package index the host's pip, npm and uv are configured with.

    ``env`` is the environment the clients run in (default: this process's); tests
    pass a fake ``HOME``. With ``cache`` (the default) an answer for the same
    :func:`client_fingerprint` younger than :data:`CACHE_TTL` is reused.
    """
    env = dict(os.environ if env is None else env)
    if not cache:
        return _ask_clients(env)
    key = client_fingerprint(env)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None and now - hit[0] < CACHE_TTL:
        log.debug("host registries (cached)", age_s=round(now - hit[0], 1))
        return hit[1]
    found = _ask_clients(env)
    with _cache_lock:
        for k in [k for k, (t, _) in _cache.items() if now - t >= CACHE_TTL]:
            del _cache[k]
        _cache[key] = (now, found)
    return found


def _ask_clients(env: Mapping[str, str]) -> tuple[RegistryURL, ...]:
    # The clients start slowly (a second or more each): ask them at the same time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        pip, npm = pool.submit(_pip, env), pool.submit(_npm, env)
        urls = [*pip.result(), *npm.result(), *_uv(env)]
    log.debug("host registries", registries=[f"{s}:{sch}://{h}:{p}" for s, sch, h, p in urls])
    return _dedupe(urls)
