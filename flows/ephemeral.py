"""`memfit run` without PREFECT_API_URL: Prefect's ephemeral server, started up front and tied to this process."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("memfit")


def bind_ephemeral_server() -> str | None:
    """Start the ephemeral server now (the flow then reuses it) and have it end with this process, even on
    SIGKILL. Returns its API URL; None when PREFECT_API_URL names a server (nothing to do).

    Prefect stops its ephemeral server at a normal exit (atexit), which a SIGKILL skips: the server would
    live on, holding its port and memory, after an out-of-memory kill of the training process. The server
    runs in a session of its own, so a signal to memfit's process group does not stop it under the flow.
    """
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    from prefect.server.api import server as server_module
    from prefect.server.api.server import SubprocessASGIServer

    from memfit.procs import reap_with_this_process

    server = SubprocessASGIServer()  # the instance Prefect's client uses when no API URL is set
    with _in_own_session(server_module):
        server.start()
    if server.server_process is not None:
        reap_with_this_process(server.server_process.pid)
    return server.api_url


@contextmanager
def _in_own_session(module: Any) -> Iterator[None]:
    """While Prefect starts its server, its Popen starts a new session: a SIGTERM to memfit's process group
    (a terminal's Ctrl-C, `kill -TERM -PGID`, a container stop) then reaches memfit alone, and the server stays
    up to record the flow run's end. Only Prefect's server module sees the change, and only meanwhile."""
    real = module.subprocess

    class _Subprocess:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def Popen(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - stands in for subprocess.Popen
            kwargs.setdefault("start_new_session", True)
            return real.Popen(*args, **kwargs)

    module.subprocess = _Subprocess()
    try:
        yield
    finally:
        module.subprocess = real
