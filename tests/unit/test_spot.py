"""The spot watcher against a fake metadata service on 127.0.0.1 (never the real cloud metadata address)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from fixtures.faults import FakeMetadata

from memfit.config.checkpoint import SpotWatcherConfig
from memfit.errors import ConfigError
from memfit.runtime.preemption import StopFlag
from memfit.runtime.spot import DEFAULT_METADATA_URL, SpotWatcher, resolve_settings, spot_watcher

pytestmark = pytest.mark.unit


@pytest.fixture()
def imds():
    server = FakeMetadata()
    yield server
    server.close()


def _watcher(url: str, **cfg) -> tuple[SpotWatcher, StopFlag, threading.Event]:
    settings = resolve_settings(SpotWatcherConfig(enabled=True, metadata_url=url, **cfg), environ={})
    stop, save = StopFlag(), threading.Event()
    return SpotWatcher(settings, stop, save), stop, save


def test_no_notice_is_a_404_and_nothing_happens(imds):
    watcher, stop, save = _watcher(imds.url)
    assert watcher.poll_once() is None and not stop.is_set() and not save.is_set()
    # IMDSv2: one token PUT, then GETs that carry it.
    assert imds.requests[0][:2] == ("PUT", "/latest/api/token")
    gets = [r for r in imds.requests if r[0] == "GET"]
    assert {p for _, p, _ in gets} == {"/latest/meta-data/spot/instance-action",
                                       "/latest/meta-data/events/recommendations/rebalance"}
    assert all(tok == FakeMetadata.TOKEN for _, _, tok in gets)


def test_interruption_notice_requests_stop_with_its_time(imds, caplog):
    watcher, stop, save = _watcher(imds.url)
    imds.instance_action = {"action": "terminate", "time": "2026-11-30T12:00:00Z"}
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.spot"):
        notice = watcher.poll_once()
    assert notice is not None and notice.kind == "interruption"
    assert stop.is_set() and "terminate at 2026-11-30T12:00:00Z" in stop.reason
    assert "2026-11-30T12:00:00Z" in caplog.text and "seen" in caplog.text


@pytest.mark.parametrize("policy, stops, saves", [("save", False, True), ("stop", True, False),
                                                   ("ignore", False, False)])
def test_rebalance_recommendation_follows_policy(imds, policy, stops, saves):
    watcher, stop, save = _watcher(imds.url, on_rebalance=policy)
    imds.rebalance = {"noticeTime": "2026-11-30T11:58:00Z"}
    assert watcher.poll_once().kind == "rebalance"
    assert stop.is_set() is stops and save.is_set() is saves
    save.clear()
    assert watcher.poll_once() is None and not save.is_set()  # the same recommendation acts once


def test_imdsv1_fallback_when_token_put_is_refused():
    server = FakeMetadata(require_token=False)
    try:
        watcher, stop, _ = _watcher(server.url)
        server.instance_action = {"action": "stop", "time": "2026-11-30T12:00:00Z"}
        assert watcher.poll_once().kind == "interruption" and stop.is_set()
        assert [r[0] for r in server.requests].count("PUT") == 1  # not retried on every poll
        assert all(tok is None for m, _, tok in server.requests if m == "GET")
    finally:
        server.close()


def test_expired_token_is_renewed(imds):
    watcher, stop, _ = _watcher(imds.url)
    watcher.poll_once()
    imds.TOKEN = "rotated"  # the old token now gets 401
    watcher.poll_once()
    imds.instance_action = {"action": "terminate", "time": "t"}
    watcher.poll_once()
    assert stop.is_set()
    assert [r[0] for r in imds.requests].count("PUT") == 2


def test_thread_polls_until_notice(imds):
    settings = resolve_settings(SpotWatcherConfig(enabled=True, metadata_url=imds.url, poll_seconds=0.05),
                                environ={})
    stop = StopFlag()
    with spot_watcher(SpotWatcherConfig(enabled=True, metadata_url=imds.url, poll_seconds=0.05), stop) as w:
        assert w is not None and w.settings == settings
        time.sleep(0.2)
        assert not stop.is_set()
        imds.instance_action = {"action": "terminate", "time": "soon"}
        assert stop.wait(5)
    assert "terminate at soon" in stop.reason


def test_unreachable_metadata_warns_once(caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    watcher, stop, _ = _watcher(f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="memfit.runtime.spot"):
        for _ in range(3):
            assert watcher.poll_once() is None
    assert caplog.text.count("cannot reach") == 1 and not stop.is_set()


def test_settings_from_environment():
    off = resolve_settings(SpotWatcherConfig(), environ={})
    assert off.enabled is False and off.base_url == DEFAULT_METADATA_URL
    env = {"MEMFIT_SPOT_WATCHER": "true", "MEMFIT_SPOT_METADATA_URL": "http://127.0.0.1:9"}
    on = resolve_settings(SpotWatcherConfig(), environ=env)
    assert on.enabled is True and on.base_url == "http://127.0.0.1:9/latest/"
    # An explicit config value wins over the environment.
    cfg = SpotWatcherConfig(enabled=False, metadata_url="http://127.0.0.1:8/latest")
    assert resolve_settings(cfg, environ=env) == resolve_settings(cfg, environ={})
    assert resolve_settings(cfg, environ={}).base_url == "http://127.0.0.1:8/latest/"
    with pytest.raises(ConfigError, match="MEMFIT_SPOT_WATCHER"):
        resolve_settings(SpotWatcherConfig(), environ={"MEMFIT_SPOT_WATCHER": "sometimes"})
    with pytest.raises(ConfigError, match="MEMFIT_SPOT_METADATA_URL"):
        resolve_settings(SpotWatcherConfig(), environ={"MEMFIT_SPOT_METADATA_URL": "metadata.internal/latest"})


def test_disabled_watcher_starts_nothing():
    with spot_watcher(SpotWatcherConfig(enabled=False), StopFlag()) as w:
        assert w is None
    assert not any(t.name == "memfit-spot-watcher" for t in threading.enumerate())
