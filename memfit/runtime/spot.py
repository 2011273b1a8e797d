"""Spot interruption watcher: polls the instance metadata service and stops training on a notice."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from memfit.config.checkpoint import SpotWatcherConfig
from memfit.errors import ConfigError
from memfit.runtime.preemption import StopFlag

log = logging.getLogger("memfit.runtime.spot")
WATCHER_THREAD = "memfit-spot-watcher"


def _local_only(record: logging.LogRecord) -> bool:
    """The watcher thread's lines stay in the process's own log: a thread has no flow-run context, so Prefect's API
    log handler (PREFECT_LOGGING_EXTRA_LOGGERS=memfit) could not send them and would warn on each."""
    if record.threadName == WATCHER_THREAD:
        record.send_to_api = False
    return True


log.addFilter(_local_only)

DEFAULT_METADATA_URL = "http://169.254.169.254/latest/"  # AWS IMDS; tests point this at 127.0.0.1
INSTANCE_ACTION = "meta-data/spot/instance-action"
REBALANCE = "meta-data/events/recommendations/rebalance"
TOKEN_PATH = "api/token"
TOKEN_TTL_S = 21600
ENV_ENABLED = "MEMFIT_SPOT_WATCHER"
ENV_URL = "MEMFIT_SPOT_METADATA_URL"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class SpotSettings:
    enabled: bool
    base_url: str  # always ends in "/latest/"
    poll_seconds: float
    timeout_seconds: float
    imdsv2: bool
    on_rebalance: str


def _normalise(url: str) -> str:
    # Accept the service root ("http://169.254.169.254") or its version path (".../latest/").
    base = url.rstrip("/")
    if not base.endswith("/latest"):
        base += "/latest"
    return base + "/"


def resolve_settings(cfg: SpotWatcherConfig, environ: Mapping[str, str] | None = None) -> SpotSettings:
    """The config wins where set; null fields fall back to $MEMFIT_SPOT_WATCHER / $MEMFIT_SPOT_METADATA_URL."""
    env = os.environ if environ is None else environ
    enabled = cfg.enabled
    if enabled is None:
        raw = env.get(ENV_ENABLED, "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise ConfigError(f"{ENV_ENABLED}={env.get(ENV_ENABLED)!r}: expected true or false "
                              "(or set checkpoint.spot.enabled)")
        enabled = raw in _TRUE
    url = cfg.metadata_url or env.get(ENV_URL) or DEFAULT_METADATA_URL
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{ENV_URL}={url!r}: expected an http:// URL such as {DEFAULT_METADATA_URL}")
    return SpotSettings(enabled=enabled, base_url=_normalise(url), poll_seconds=cfg.poll_seconds,
                        timeout_seconds=cfg.timeout_seconds, imdsv2=cfg.imdsv2, on_rebalance=cfg.on_rebalance)


@dataclass
class Notice:
    kind: str  # "interruption" or "rebalance"
    detail: dict[str, Any]
    seen_at: float  # time.time() when the watcher saw it

    def describe(self) -> str:
        seen = datetime.fromtimestamp(self.seen_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if self.kind == "interruption":
            return (f"spot interruption notice: {self.detail.get('action', '?')} at "
                    f"{self.detail.get('time', '?')} (seen {seen})")
        return f"spot rebalance recommendation at {self.detail.get('noticeTime', '?')} (seen {seen})"


class SpotWatcher:
    """A daemon thread polling `<base>/meta-data/spot/instance-action` and the rebalance recommendation.

    404 means no notice. An interruption notice requests `stop` (the training loop then finishes its step,
    saves and exits 75); a rebalance recommendation sets `save_request` (or stops, or is only logged).
    """

    def __init__(self, settings: SpotSettings, stop: StopFlag, save_request: threading.Event | None = None):
        self.settings, self.stop, self.save_request = settings, stop, save_request
        self.notices: list[Notice] = []
        self._token: str | None = None
        self._token_expiry = 0.0
        self._v1_only = not settings.imdsv2
        self._unreachable_logged = False
        self._rebalance_seen: set[str] = set()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        # No proxy: the metadata address is link-local, a corporate HTTP_PROXY must never see it.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- HTTP ---------------------------------------------------------------------------------------
    def _request(self, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.settings.base_url + path, method=method, headers=headers or {})
        try:
            with self._opener.open(req, timeout=self.settings.timeout_seconds) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, b""

    def _auth_headers(self) -> dict[str, str]:
        if self._v1_only:
            return {}
        if self._token is None or time.monotonic() >= self._token_expiry:
            status, body = self._request(TOKEN_PATH, "PUT",
                                         {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status == 200 and body:
                self._token = body.decode().strip()
                self._token_expiry = time.monotonic() + TOKEN_TTL_S - 60
            else:
                log.info("spot watcher: no IMDSv2 token (PUT %s answered %s); using IMDSv1 requests",
                         self.settings.base_url + TOKEN_PATH, status)
                self._v1_only = True
                return {}
        return {"X-aws-ec2-metadata-token": self._token or ""}

    def _get_json(self, path: str) -> dict[str, Any] | None:
        status, body = self._request(path, headers=self._auth_headers())
        if status == 401:  # the token expired or was revoked: take a new one next time
            self._token = None
            return None
        if status != 200:
            return None  # 404: no notice
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            doc = {"raw": body.decode(errors="replace")[:200]}
        return doc if isinstance(doc, dict) else {"raw": str(doc)[:200]}

    # -- polling ------------------------------------------------------------------------------------
    def poll_once(self) -> Notice | None:
        """One poll of both endpoints; acts on what it finds and returns it (None: nothing new)."""
        try:
            action = self._get_json(INSTANCE_ACTION)
            rebalance = None if action else self._get_json(REBALANCE)
        except (urllib.error.URLError, OSError) as err:
            if not self._unreachable_logged:
                log.warning("spot watcher cannot reach %s (%s); still polling every %.0f s", self.settings.base_url,
                            getattr(err, "reason", err), self.settings.poll_seconds)
                self._unreachable_logged = True
            return None
        if action:
            notice = Notice("interruption", action, time.time())
            self.notices.append(notice)
            log.warning("%s: finishing the current optimizer step, then saving a training checkpoint",
                        notice.describe())
            self.stop.request(notice.describe())
            return notice
        if rebalance:
            key = str(rebalance.get("noticeTime", rebalance))
            if key in self._rebalance_seen:
                return None
            self._rebalance_seen.add(key)
            notice = Notice("rebalance", rebalance, time.time())
            self.notices.append(notice)
            action_word = self.settings.on_rebalance
            log.warning("%s: checkpoint.spot.on_rebalance=%s", notice.describe(), action_word)
            if action_word == "stop":
                self.stop.request(notice.describe())
            elif action_word == "save" and self.save_request is not None:
                self.save_request.set()
            return notice
        return None

    def _run(self) -> None:
        while not self._halt.is_set() and not self.stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the watcher must never take training down
                log.exception("spot watcher poll failed; still polling")
            self._halt.wait(self.settings.poll_seconds)

    def start(self) -> SpotWatcher:
        self._thread = threading.Thread(target=self._run, name=WATCHER_THREAD, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.timeout_seconds * 3 + 1)


@contextmanager
def spot_watcher(cfg: SpotWatcherConfig, stop: StopFlag, save_request: threading.Event | None = None
                 ) -> Iterator[SpotWatcher | None]:
    """Run a SpotWatcher for the duration of the block when enabled (config or $MEMFIT_SPOT_WATCHER)."""
    settings = resolve_settings(cfg)
    if not settings.enabled:
        yield None
        return
    log.info("spot watcher on: polling %s%s every %.1f s", settings.base_url, INSTANCE_ACTION, settings.poll_seconds)
    watcher = SpotWatcher(settings, stop, save_request).start()
    try:
        yield watcher
    finally:
        watcher.close()
