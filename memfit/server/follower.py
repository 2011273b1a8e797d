"""The model serving now, and the thread that follows a registry alias: load, check, swap, or keep the old one."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from memfit.server.background import BackgroundLoop

log = logging.getLogger("memfit.server")


@dataclass
class Holder:
    """`current` is swapped by one assignment: a batch that already took the old model finishes on it."""

    current: Any
    last_error: str | None = None
    swaps: list[dict[str, Any]] = field(default_factory=list)

    def swap(self, new: Any) -> None:
        old = self.current
        self.current = new
        self.last_error = None
        self.swaps.append({"from": old.model_id, "to": new.model_id, "at": time.time()})
        log.info("now serving %s (was %s)", new.model_id, old.model_id)


class Follower(BackgroundLoop):
    """Polls the alias every `poll_s`; a new version is fetched, verified, loaded and smoke-checked off the
    request path, then swapped in. A version that fails is reported once and not retried until the alias moves."""

    def __init__(self, holder: Holder, source: Any, load: Any, poll_s: float, metrics: Any = None):
        super().__init__("memfit-follow-alias", join_s=10)
        self.holder, self.source, self.load, self.poll_s, self.metrics = holder, source, load, poll_s, metrics
        self.failed: str | None = None
        self.lock = threading.Lock()  # the poll thread and POST /admin/refresh never load the same version twice

    def _run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            self.poll_once()

    def poll_once(self) -> str | None:
        """One poll: the version now served after it (a swap or not); errors are logged, never raised."""
        with self.lock:
            return self._poll()

    def _poll(self) -> str | None:
        try:
            version = self.source.current_version()
        except Exception as err:  # noqa: BLE001 - the registry being away must not stop the serving
            self._report(f"cannot read {self.source.uri}: {err}; still serving {self.holder.current.model_id}",
                         count=False)
            return self.holder.current.files.version
        if version in (self.holder.current.files.version, self.failed):
            return self.holder.current.files.version
        log.info("%s moved to version %s: loading it in the background", self.source.uri, version)
        try:
            new = self.load(self.source.fetch(version))
        except Exception as err:  # noqa: BLE001 - any failure keeps the old model
            self.failed = version
            self._report(f"version {version} of {self.source.uri} failed to load ({err}); kept "
                         f"{self.holder.current.model_id}", count=True)
            return self.holder.current.files.version
        self.failed = None
        self.holder.swap(new)
        if self.metrics is not None:
            self.metrics.swap("ok", new.model_id)
        return version

    def _report(self, message: str, count: bool) -> None:
        log.warning(message)
        self.holder.last_error = message
        if count and self.metrics is not None:
            self.metrics.swap("failed", self.holder.current.model_id)
