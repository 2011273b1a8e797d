"""Start-up of `memfit serve-model`: resolve MODEL, load and check it, bind the port, run uvicorn."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.config import MemfitConfig
from memfit.errors import ConfigError

log = logging.getLogger("memfit.server")


def default_model(cfg: MemfitConfig) -> str:
    """MODEL when none is given: the config's registered model at its alias (champion by default)."""
    return f"models:/{cfg.registry.model_name or cfg.run.name}@{cfg.registry.alias}"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads: a port in use is one line, not a traceback."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"serve.port {port} on {host} is in use: stop what listens there or pick another "
                              "port (--port or --set serve.port=...)") from None
        raise ConfigError(f"serve.host {host}:{port}: cannot listen there ({err.strerror}); use an address of "
                          "this machine (127.0.0.1, 0.0.0.0)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def build(cfg: MemfitConfig, model: str | None = None) -> Any:
    """The app and its parts (state, engine, follower) for MODEL, loaded and checked; nothing listens yet."""
    from memfit.server import model as served_model
    from memfit.server.app import ServerState, create_app
    from memfit.server.engine import Engine
    from memfit.server.follower import Follower, Holder
    from memfit.server.metrics import Metrics
    from memfit.server.sources import resolve

    s = cfg.serve
    uri = model or default_model(cfg)
    want_onnx = s.backend == "onnx" or (s.backend == "auto" and s.device != "cuda")
    files, source = resolve(uri, cfg.tracking.resolved_uri(), Path(s.cache_dir), want_onnx)

    def load(f: Any) -> Any:
        return served_model.load(f, s)

    holder = Holder(current=load(files))
    metrics = Metrics()
    metrics.serving(holder.current.model_id)
    engine = Engine(holder, s.max_batch_size, s.max_queue, s.batch_wait_ms, metrics)
    follower = None
    if source is not None and source.follows and s.follow_alias:
        follower = Follower(holder, source, load, s.poll_seconds, metrics)
    aliases = {uri} | ({f"{source.name}@{source.alias}"} if source is not None and source.alias else set())
    state = ServerState(holder=holder, engine=engine, metrics=metrics, aliases=aliases, follower=follower)
    return create_app(state), state


@dataclass
class Running:
    """A server running in a thread of this process (tests, benchmarks, a flow step); `stop()` ends it."""

    url: str
    server: Any
    thread: threading.Thread
    state: Any

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        _stop_parts(self.state)


def _uvicorn(app: Any, sock: socket.socket) -> Any:
    import uvicorn

    host, port = sock.getsockname()[:2]
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))


def _start_parts(state: Any) -> None:
    state.engine.start()
    if state.follower is not None:
        state.follower.start()


def _stop_parts(state: Any) -> None:
    if state.follower is not None:
        state.follower.stop()
    state.engine.stop()


def _ready(cfg: MemfitConfig, model: str | None, port: int) -> tuple[Any, Any, Any]:
    """The port bound first (a port in use fails before the model loads), then the model, app and workers."""
    sock = bind(cfg.serve.host, port)
    try:
        app, state = build(cfg, model)
    except BaseException:
        sock.close()
        raise
    server = _uvicorn(app, sock)
    _start_parts(state)
    return sock, server, state


def start_in_thread(cfg: MemfitConfig, model: str | None = None, port: int | None = None) -> Running:
    """Build, bind (port 0: any free one) and serve from a thread; returns once it accepts connections."""
    sock, server, state = _ready(cfg, model, cfg.serve.port if port is None else port)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="memfit-uvicorn", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(timeout=0.05)
    host, bound = sock.getsockname()[:2]
    return Running(url=f"http://{host}:{bound}", server=server, thread=thread, state=state)


def serve(cfg: MemfitConfig, model: str | None = None) -> None:
    """`memfit serve-model`: serve until Ctrl-C / SIGTERM (uvicorn's handlers end it gracefully)."""
    sock, server, state = _ready(cfg, model, cfg.serve.port)
    served = state.holder.current
    log.info("serving %s (%s backend) on http://%s:%d/v1%s", served.model_id, served.backend.name, cfg.serve.host,
             cfg.serve.port, f", following {state.follower.source.uri}" if state.follower else "")
    try:
        server.run(sockets=[sock])
    finally:
        _stop_parts(state)
