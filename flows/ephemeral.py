"""`memfit run` without PREFECT_API_URL: Prefect's ephemeral server, started up front and tied to this process."""

from __future__ import annotations

import logging

log = logging.getLogger("memfit")


def bind_ephemeral_server() -> str | None:
    """Start the ephemeral server now (the flow then reuses it) and have it end with this process, even on
    SIGKILL. Returns its API URL; None when PREFECT_API_URL names a server (nothing to do).

    Prefect stops its ephemeral server at a normal exit (atexit), which a SIGKILL skips: the server would
    live on, holding its port and memory, after an out-of-memory kill of the training process.
    """
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    from memfit.procs import reap_with_this_process

    server = SubprocessASGIServer()  # the instance Prefect's client uses when no API URL is set
    server.start()
    if server.server_process is not None:
        reap_with_this_process(server.server_process.pid)
    return server.api_url
