"""The server's background loops (batch generation, alias following): one daemon thread each, stopped by an Event."""

from __future__ import annotations

import threading
from typing import Any


class BackgroundLoop:
    """Runs `self._run` on a daemon thread from `start()`; `_run` returns once `self.stopping` is set."""

    def __init__(self, name: str, join_s: float) -> None:
        self.stopping = threading.Event()
        self.join_s = join_s
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:  # pragma: no cover - each loop defines its own
        raise NotImplementedError

    def start(self) -> Any:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.join_s)
