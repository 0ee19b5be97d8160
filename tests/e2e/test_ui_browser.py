"""``agentbox ui`` in a real headless Chromium (Debian's, driven by selenium through
``chromium-driver``) against a real launcher running real tasks with the real Claude Code:
the login link, the list updating when a task ends, the transcript growing while the
agent runs, cancel with its confirmation, agent-written markup shown as inert text,
another user's task not reachable by URL, and the Host/Origin/session checks. Each
page's screenshot is kept under ``$AGENTBOX_TEST_ARTIFACTS/ui/``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from git_helpers import git
from task_cleanup import sweep

CHROMIUM = Path("/usr/bin/chromium")
DRIVER = Path("/usr/bin/chromedriver")
VENV_PYTHON = Path("/opt/agentbox/venv/bin/python")
ARTIFACTS = Path(os.environ.get("AGENTBOX_TEST_ARTIFACTS", "/var/tmp/agentbox-test-artifacts"))

pytestmark = [
    pytest.mark.podman,
    pytest.mark.claude,
    pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root"),
    pytest.mark.chromium,  # a required facility in scripts/test.sh: never skipped silently
]

NAPPER = """\
name: napper
turns:
  - text: "First a look."
    tool_use:
      - name: Bash
        input: {command: "echo looking; sleep 3; echo looked", description: look}
  - text: "Then a nap."
    tool_use:
      - name: Bash
        input: {command: "python3 -c 'import time; time.sleep(6)'; echo woke", description: nap}
  - text: "Writing."
    tool_use:
      - name: Write
        input: {file_path: "{{cwd}}/nap.txt", content: "rested\\n"}
  - text: "Done napping."
"""

SLEEPER = """\
name: sleeper
turns:
  - text: "Sleeping long."
    tool_use:
      - name: Bash
        input:
          command: "python3 -c 'import time; time.sleep(120)'"
          description: long nap
          timeout: 300000
  - text: "Woke."
"""

# What a prompt-injected agent writes to attack the page that shows it.
EVIL = """\
name: evil
turns:
  - text: "<script>document.title='PWNED'</script> [click](javascript:alert(1)) \\u001b[31mred"
    tool_use:
      - name: Write
        input:
          file_path: "{{cwd}}/page.html"
          content: "<img src=x onerror=alert(2)><script>alert(3)</script>\\n\\
            <a href=\\"javascript:alert(4)\\">x</a>\\n"
      - name: Bash
        input: {command: "printf '\\\\033[2J\\\\033[31mcleared<b>bold</b>\\\\n'", description: ansi}
  - text: "<iframe src=\\"javascript:alert(5)\\"></iframe>done"
"""


@dataclass
class World:
    base: Path
    env: dict[str, str]
    ui_url: str
    login: str

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentbox", *args], env=self.env,
                              capture_output=True, text=True, timeout=600, check=False)  # fmt: skip

    def submit(self, model: str, text: str) -> str:
        repo = self.base / "repos" / f"r-{model}-{time.monotonic_ns()}"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "README.md").write_text("hi\n")
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
        r = self.cli("run", "--detach", "--json", "--model", model, "--repo", str(repo), text)
        assert r.returncode == 0, (r.stdout, r.stderr)
        return str(json.loads(r.stdout)["id"])


def _start_ui(argv: list[str], env: dict[str, str], **kw: Any) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    if not first.startswith("http://127.0.0.1:"):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"no login link first: {first!r} {err[-2000:]}")
    return proc, first


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="agentbox-e2e-ui-", dir="/var/tmp"))
    base.chmod(0o755)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    for name, script in (("napper", NAPPER), ("sleeper", SLEEPER), ("evil", EVIL)):
        (base / f"{name}.yaml").write_text(script)
    (base / "models.toml").write_text(
        'default = "napper"\n'
        + "".join(
            f'[models.{n}]\nkind = "replay"\nupstream = "{n}.yaml"\n'
            for n in ("napper", "sleeper", "evil")
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    launcher = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "launcher", "serve"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    ui = None
    try:
        sock = base / "data" / "run" / "launcher.sock"
        end = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < end:
            time.sleep(0.1)
        ui, login = _start_ui(
            [sys.executable, "-m", "agentbox", "ui", "--listen", "127.0.0.1:0"], env
        )
        yield World(base, env, login.split("/login")[0], login)
    finally:
        if ui is not None:
            _stop(ui)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=120)
        sweep(base, env)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000"):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: webdriver.Chrome, name: str) -> None:
    out = ARTIFACTS / "ui"
    out.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out / f"{name}.png"))


def _until(
    check: Callable[[], Any],
    timeout: float = 180,
    what: str = "",
    driver: webdriver.Chrome | None = None,
) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    seen = driver.find_element(By.TAG_NAME, "body").text[-3000:] if driver is not None else ""
    raise AssertionError(f"timed out waiting for {what or check}; the page said:\n{seen}")


def _text(driver: webdriver.Chrome, css: str) -> str:
    """The first match's text; "" if none (the live page replaces its rows as it goes)."""
    try:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        return found[0].text if found else ""
    except StaleElementReferenceException:
        return ""


def _row_status(driver: webdriver.Chrome, task_id: str) -> str:
    return _text(driver, f'tr[data-id="{task_id}"] td.status')


def _status(driver: webdriver.Chrome) -> str:
    return _text(driver, "#status")


def test_login_then_the_list_and_the_transcript_update_live(
    world: World, browser: webdriver.Chrome
) -> None:
    browser.get(world.login)
    assert browser.current_url == world.ui_url + "/"  # the link set the cookie and redirected
    cookie = browser.get_cookie("agentbox_ui")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    task_id = world.submit("napper", "Nap, then write nap.txt")
    # the list, never reloaded, shows the task and then its end
    marker = browser.execute_script("window.__same_page = 1; return window.__same_page;")
    assert marker == 1
    _until(lambda: _row_status(browser, task_id) in ("running", "queued"), what="running row")
    _shot(browser, "list-running")
    # the task's page while the agent runs: its transcript grows without a reload
    browser.get(f"{world.ui_url}/tasks/{task_id}")
    browser.execute_script("window.__same_page = 2;")
    first = len(browser.find_elements(By.CSS_SELECTOR, "#events li.event"))
    _until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#events li.event")) > first + 2,
           what="the transcript to grow")  # fmt: skip
    assert browser.execute_script("return window.__same_page;") == 2
    _shot(browser, "task-running")
    texts = browser.find_element(By.ID, "events").text
    assert "looking" in texts or "echo looking" in texts
    # it ends: the page reloads itself once with the report and the diff
    _until(lambda: _status(browser) == "done", what="done")
    _until(lambda: browser.find_elements(By.CSS_SELECTOR, "pre.diff"), what="the diff")
    assert "nap.txt" in browser.find_element(By.CSS_SELECTOR, "nav.tree").text
    assert "cpu" in _text(browser, "#resources")  # what the task used (its cgroup's figures)
    assert browser.find_elements(By.CSS_SELECTOR, "pre.diff span.add")
    _shot(browser, "task-done")
    browser.get(world.ui_url + "/")
    browser.execute_script("window.__same_page = 3;")
    _until(lambda: _row_status(browser, task_id) == "done", what="done row")
    other = world.submit("napper", "Nap again")
    _until(lambda: _row_status(browser, other) == "done", timeout=240, what="the new task's end")
    assert browser.execute_script("return window.__same_page;") == 3  # live, not reloaded
    _shot(browser, "list-done")


def test_cancel_asks_then_cancels(world: World, browser: webdriver.Chrome) -> None:
    browser.get(world.login)
    task_id = world.submit("sleeper", "Sleep long")
    browser.get(f"{world.ui_url}/tasks/{task_id}")
    _until(lambda: _status(browser) == "running", what="running")
    browser.find_element(By.ID, "cancel").click()
    alert = browser.switch_to.alert
    assert "Cancel task" in alert.text
    alert.dismiss()  # "no": nothing happens
    time.sleep(1.5)
    assert _status(browser) == "running"
    browser.find_element(By.ID, "cancel").click()
    browser.switch_to.alert.accept()
    _until(lambda: _status(browser) == "cancelled", 120, "cancelled", browser)
    _shot(browser, "task-cancelled")


def test_agent_written_markup_is_inert_text(world: World, browser: webdriver.Chrome) -> None:
    browser.get(world.login)
    task_id = world.submit("evil", "Write a page")
    r = world.cli("wait", task_id, "--timeout", "300")
    assert r.returncode == 0, (r.stdout, r.stderr)
    browser.get(f"{world.ui_url}/tasks/{task_id}")
    _shot(browser, "task-evil")
    with pytest.raises(NoAlertPresentException):
        _ = browser.switch_to.alert.text
    assert browser.title != "PWNED"
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "<script>document.title='PWNED'</script>" in body
    assert "[click](javascript:alert(1))" in body
    assert "\\x1b[31mred" in body  # the ANSI sequence, shown as an escape
    assert "<img src=x onerror=alert(2)>" in body  # the diff, as text
    for css in ("script:not([src])", "img", "iframe", 'a[href^="javascript"]', "[onerror]"):
        assert browser.find_elements(By.CSS_SELECTOR, css) == [], css
    scripts = [s.get_attribute("src") for s in browser.find_elements(By.TAG_NAME, "script")]
    assert scripts == [world.ui_url + "/static/app.js"]
    links = {a.get_attribute("href") for a in browser.find_elements(By.TAG_NAME, "a")}
    assert all(h and h.startswith(world.ui_url) for h in links), links


def test_another_users_task_is_not_reachable(world: World, browser: webdriver.Chrome) -> None:
    """The view of a member of agentbox shows that user's tasks only: root's task, by URL,
    is "No such task" (the launcher answers per SO_PEERCRED)."""
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/setup.sh (it installs it)")
    root_task = world.submit("napper", "Root's own task")
    uid = 64341
    gid = _agentbox_gid()
    home = world.base / f"home-{uid}"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, uid, uid)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home),
           "AGENTBOX_DATA_DIR": world.env["AGENTBOX_DATA_DIR"]}  # fmt: skip
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={gid}", "--",
            str(VENV_PYTHON), "-m", "agentbox", "ui", "--listen", "127.0.0.1:0"]  # fmt: skip
    proc, login = _start_ui(argv, env, cwd="/")
    try:
        base = login.split("/login")[0]
        browser.get(login)
        assert browser.find_elements(By.CSS_SELECTOR, f'tr[data-id="{root_task}"]') == []
        browser.get(f"{base}/tasks/{root_task}")
        assert browser.find_element(By.TAG_NAME, "h1").text == "No such task"
        _shot(browser, "other-users-task")
        with httpx.Client(base_url=base) as c:
            c.get(login)
            assert c.get(f"/tasks/{root_task}").status_code == 404
    finally:
        _stop(proc)


def test_host_origin_session_and_form_token_are_checked(world: World) -> None:
    with httpx.Client(base_url=world.ui_url, follow_redirects=False) as c:
        assert c.get("/").status_code == 401  # no session
        assert c.get("/login", params={"token": "wrong"}).status_code == 403
        assert c.get(world.login).status_code == 303
        ok = c.get("/")
        assert ok.status_code == 200
        csp = ok.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert ok.headers["x-frame-options"] == "DENY"
        # a DNS-rebinding page reaches us under its own name
        assert c.get("/", headers={"Host": "evil.example:80"}).status_code == 403
        task_id = world.submit("sleeper", "Sleep to be cancelled by a forged form")
        try:
            forged = c.post(f"/tasks/{task_id}/cancel", data={"csrf": "x"},
                            headers={"Origin": "http://evil.example"})  # fmt: skip
            assert forged.status_code == 403
            no_token = c.post(f"/tasks/{task_id}/cancel", data={"csrf": "x"},
                              headers={"Origin": world.ui_url})  # fmt: skip
            assert no_token.status_code == 409
            info = json.loads(world.cli("show", task_id, "--json").stdout)
            assert info["task"]["status"] in ("queued", "running")  # the forged cancel did nothing
        finally:
            world.cli("cancel", task_id)


def _agentbox_gid() -> int:
    import grp

    return grp.getgrnam("agentbox").gr_gid


def test_a_batchs_per_node_table(world: World, browser: webdriver.Chrome) -> None:
    """A batch's state (as the driver keeps it under the data dir): the batches list links
    it, its page counts tasks per node, and a node's error text stays text."""
    from agentbox.cluster import BatchState

    d = world.base / "data" / "batches" / "b1"
    d.mkdir(parents=True, mode=0o700)
    st = BatchState(d / "batch.db")
    try:
        st.init("b1", budget=None, options={})
        rows = [("k1", "node-a", "done", 100, ""), ("k2", "node-a", "failed", 50,
                 "<script>alert(7)</script>"), ("k3", "node-b", "done", 70, ""),
                ("k4", "", "", 0, "")]  # fmt: skip
        for seq, (key, node, status, tokens, error) in enumerate(rows):
            st.add_task(key, seq, {"task": "t"}, "/r", "0" * 40)
            if node:
                st.place(key, f"{key}-a1", 10, None)
                st.update(key, node=node, status=status, tokens=tokens, error=error)
    finally:
        st.close()
    browser.get(world.login)
    browser.get(world.ui_url + "/batches")
    browser.find_element(By.LINK_TEXT, "b1").click()
    cells = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in browser.find_elements(By.CSS_SELECTOR, "table.nodes tbody tr")
    ]
    assert any(c[:6] == ["node-a", "2", "1", "1", "0", "150"] for c in cells), cells
    assert any(c[:6] == ["node-b", "1", "1", "0", "0", "70"] for c in cells), cells
    assert "<script>alert(7)</script>" in browser.find_element(By.TAG_NAME, "body").text
    with pytest.raises(NoAlertPresentException):
        _ = browser.switch_to.alert.text
    _shot(browser, "batch")
