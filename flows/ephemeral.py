"""`memfit run` without PREFECT_API_URL: Prefect's ephemeral server, started first and tied to this process."""

from __future__ import annotations

import atexit
import http.client
import importlib.util
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from memfit.errors import MemfitError
from memfit.runtime.termination import stop_signals_deferred

log = logging.getLogger("memfit")

# Set to the API URL of the server this memfit process started (PREFECT_API_URL then names it too): the API is
# an ephemeral server, with none of a real server's background services (tasks/slots.py picks its slots by it).
OWN_SERVER_ENV = "MEMFIT_EPHEMERAL_PREFECT_API_URL"
# The environment Prefect's own ephemeral mode gives its server (SubprocessASGIServer): no UI, no services.
_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
_PORTS = range(8000, 9000)  # Prefect's range for its ephemeral servers
_PORT_IN_USE = 3  # uvicorn's exit code when it cannot bind


class ServerStartError(MemfitError):
    """The ephemeral Prefect server did not start (the message says what to change)."""


class EphemeralServer:
    """The uvicorn process Prefect's ephemeral mode would start, but started by memfit before torch, the flow
    and Prefect itself are imported (a process of its own: a thread would share the GIL with those imports).

    PREFECT_API_URL is set to it, so Prefect in this process never imports its server module (~4 s) and uses
    this server as it would any other. A reaper, started before the server, ends it with this process, even on
    SIGKILL; the server runs in a session of its own, so a signal to memfit's process group does not stop it
    under the flow (which then records its own end). At a normal exit it is stopped after Prefect's own at-exit
    work (registered before it, so it runs after it), as Prefect stops its ephemeral server.
    """

    def __init__(self) -> None:
        from memfit.runtime.procs import Reaper

        self._reaper = Reaper()
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        # The server gets the environment as it is now: it is the API, it must not look for one.
        self._server_env = {**os.environ, **_SERVER_ENV}
        self._saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", OWN_SERVER_ENV, "PREFECT_UI_URL")}
        atexit.register(self.stop)
        self._launch()
        # Whether it answers yet, known without waiting: a request to a server still booting can block for the
        # whole timeout (the port is bound, its process busy importing), so a thread asks, not the warm-up.
        self._answered = threading.Event()
        threading.Thread(target=self._watch_health, name="memfit-server-health", daemon=True).start()
        # No UI in an ephemeral server: Prefect's "View at <url>" line would name a page that does not exist.
        os.environ.setdefault("PREFECT_UI_URL", "")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _launch(self) -> None:
        self.port = _free_port()
        log.info("Starting temporary server on http://127.0.0.1:%d", self.port)
        args = ["--app-dir", str(_prefect_parent()), "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        # A Ctrl-C or SIGTERM between the fork and the reaper's watch would leave a server nobody ends (seen
        # under load, and in CI when the handler's exception left Popen after its fork): both are handled once
        # the pid is watched.
        with stop_signals_deferred():
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _UVICORN, *args], env=self._server_env, start_new_session=True)
            self._reaper.watch(self.proc.pid)
        os.environ["PREFECT_API_URL"] = os.environ[OWN_SERVER_ENV] = self.api_url

    def wait(self, timeout: float | None = None) -> str:
        """Block until the server answers /api/health; restart it on another port if its port was taken."""
        limit = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "60"))
        deadline = time.monotonic() + limit
        while not self._healthy():
            assert self.proc is not None
            code = self.proc.poll()
            if code == _PORT_IN_USE:  # another process took the port between our check and the server's bind
                self._launch()
            elif code is not None:
                raise ServerStartError(f"the ephemeral Prefect server exited with code {code} before it was healthy "
                                   f"(PREFECT_HOME={os.environ.get('PREFECT_HOME', '~/.prefect')})")
            if time.monotonic() > deadline:
                raise ServerStartError(f"the ephemeral Prefect server was not healthy within {limit:.0f} s; raise "
                                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a busy machine")
            time.sleep(0.1)
        return self.api_url

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Wait for the server, then run the block against it (also when Prefect was imported before the URL was
        set, as in a test process: its settings are read at import)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        url = self.wait()
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url

    def answers(self) -> bool:
        """Whether the server has answered /api/health (no waiting)."""
        return self._answered.is_set()

    def _watch_health(self) -> None:
        while self.proc is not None and self.proc.poll() is None:
            if self._healthy():
                self._answered.set()
                return
            time.sleep(0.1)

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/api/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        """Terminate the server (kill after 5 s) and put PREFECT_API_URL back as it was; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for key, value in self._saved.items():
            if os.environ.get(key) in (self.api_url, ""):
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


# The server boots beside memfit's own start-up (≈ 7.5 s of CPU to be healthy on a warm home, most of it
# imports), on the other core. memfit's process is the critical path, so it wins a contended core; the tracking
# process (child.py, nice 10, needed only from phase 3 on) loses to the server, which the flow needs first.
SERVER_NICE = 5
# `python -m uvicorn ARGS` at SERVER_NICE. A thread then waits for the server's health and makes the first requests
# Prefect's client makes: the server's first answer costs it ≈ 1 s of CPU (lazy set-up in Prefect's server), spent
# now, while memfit still imports, instead of while its flow run waits. Read-only requests: nothing is written
# to the database.
_UVICORN = f"""
import http.client, os, runpy, sys, threading, time
try:
    os.nice({SERVER_NICE})
except OSError:
    pass
def warm(port):
    for _ in range(3000):
        try:
            for method, path in (("GET", "/api/health"), ("GET", "/api/admin/version"),
                                 ("POST", "/api/flows/filter"), ("POST", "/api/flow_runs/filter")):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request(method, path, body="{{}}" if method == "POST" else None,
                             headers={{"Content-Type": "application/json"}})
                conn.getresponse().read()
                conn.close()
            return
        except OSError:
            time.sleep(0.1)
threading.Thread(target=warm, args=(int(sys.argv[sys.argv.index("--port") + 1]),), daemon=True).start()
sys.argv = ["uvicorn", *sys.argv[1:]]
runpy.run_module("uvicorn", run_name="__main__")
"""


def api_url_configured(cwd: Path | None = None) -> bool:
    """Whether Prefect settings name a server, read without importing Prefect (~0.5 s) unless a settings file
    (profile, .env, prefect.toml, pyproject.toml) could name one."""
    if "prefect.settings" in sys.modules or _settings_file_may_set_api(cwd or Path.cwd()):
        from prefect.settings import PREFECT_API_URL

        return bool(PREFECT_API_URL.value())
    return bool(os.environ.get("PREFECT_API_URL"))


def _settings_file_may_set_api(cwd: Path) -> bool:
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    candidates: list[tuple[Path, Callable[[str], bool]]] = [
        (Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser(),
         lambda text: "PREFECT_API_URL" in text),
        (cwd / ".env", lambda text: "PREFECT_API_URL" in text),
        (cwd / "prefect.toml", lambda text: True),
        (cwd / "pyproject.toml", lambda text: "[tool.prefect" in text),
    ]
    for path, may_set in candidates:
        try:
            if path.is_file() and may_set(path.read_text(errors="replace")):
                return True
        except OSError:
            continue
    return False


def start_ephemeral_server() -> EphemeralServer | None:
    """Start the ephemeral server now, in the background; None when the settings name a server (nothing to do).

    Prefect stops its ephemeral server at a normal exit (atexit), which a SIGKILL skips: the server would
    live on, holding its port and memory, after an out-of-memory kill of the training process. So a reaper
    ends it with this process.
    """
    if api_url_configured():
        return None
    return EphemeralServer()


def _prefect_parent() -> Path:
    spec = importlib.util.find_spec("prefect")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ServerStartError("prefect is not installed in this environment (pip install -e .)")
    return Path(spec.origin).parent.parent


def _free_port() -> int:
    for _ in range(20):
        port = random.choice(_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerStartError("no free port between 8000 and 8999 for the ephemeral Prefect server")
