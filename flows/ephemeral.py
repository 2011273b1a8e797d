"""`memfit run` without PREFECT_API_URL: Prefect's ephemeral server, started early and tied to this process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("memfit")


class PendingServer:
    """The ephemeral server starting in a thread while the main thread imports torch and the flow (~8 s each
    on 2 cores, overlapped). `wait()` before the flow runs: the flow then reuses this server."""

    def __init__(self) -> None:
        from memfit.procs import Reaper

        self.error: BaseException | None = None
        self.api_url: str | None = None
        # Started from the main thread, before the server exists: from its first instant the server is tied to
        # this process, so a SIGKILL at any moment of the start-up leaves no server behind.
        self._reaper = Reaper()
        self._thread = threading.Thread(target=self._start, name="memfit-prefect-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            from prefect.server.api import server as server_module
            from prefect.server.api.server import SubprocessASGIServer

            server = SubprocessASGIServer()  # the instance Prefect's client uses when no API URL is set
            with _in_own_session(server_module, self._reaper.watch):
                server.start()
            self.api_url = server.api_url
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread by wait()
            self.error = err

    def wait(self) -> str | None:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.api_url


def start_ephemeral_server() -> PendingServer | None:
    """Start the ephemeral server in the background; None when PREFECT_API_URL names a server (nothing to do).

    Prefect stops its ephemeral server at a normal exit (atexit), which a SIGKILL skips: the server would
    live on, holding its port and memory, after an out-of-memory kill of the training process. So a reaper
    ends it with this process. The server runs in a session of its own, so a signal to memfit's process group
    does not stop it under the flow (which then records its own end).
    """
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    return PendingServer()


@contextmanager
def _in_own_session(module: Any, on_start: Any) -> Iterator[None]:
    """While Prefect starts its server, its Popen starts a new session and reports the new process to
    `on_start` (the reaper). Only Prefect's server module sees the change, and only meanwhile."""
    real = module.subprocess

    class _Subprocess:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def Popen(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - stands in for subprocess.Popen
            kwargs.setdefault("start_new_session", True)
            proc = real.Popen(*args, **kwargs)
            on_start(proc.pid)
            return proc

    module.subprocess = _Subprocess()
    try:
        yield
    finally:
        module.subprocess = real
