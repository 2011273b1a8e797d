"""Which Prefect API `memfit run` uses: its own ephemeral server unless a setting names one, and the slots it
picks for each (the ephemeral server has no lease reaper)."""

from __future__ import annotations

import pytest

from flows.ephemeral import OWN_SERVER_ENV, _settings_file_may_set_api

pytestmark = pytest.mark.unit


@pytest.fixture()
def no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    cwd = tmp_path / "project"
    cwd.mkdir()
    return cwd


def test_no_settings_file_means_no_prefect_import_is_needed(no_profile):
    (no_profile / "pyproject.toml").write_text("[tool.ruff]\nline-length = 120\n")
    (no_profile / ".env").write_text("MLFLOW_TRACKING_URI=sqlite:///x.db\n")
    assert not _settings_file_may_set_api(no_profile)


@pytest.mark.parametrize("name, text", [
    ("home/profiles.toml", 'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:4999/api"\n'),
    ("project/.env", "PREFECT_API_URL=http://127.0.0.1:4200/api\n"),
    ("project/prefect.toml", '[api]\nurl = "http://127.0.0.1:4200/api"\n'),
    ("project/pyproject.toml", '[tool.prefect.api]\nurl = "http://127.0.0.1:4200/api"\n'),
])
def test_a_settings_file_that_may_name_a_server_is_read_by_prefect(no_profile, name, text):
    path = no_profile.parent / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    assert _settings_file_may_set_api(no_profile)


def test_slots_are_file_locks_on_memfits_own_server_and_leases_on_any_other(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.slots import ephemeral_mode

    own = "http://127.0.0.1:8123/api"
    monkeypatch.setenv(OWN_SERVER_ENV, own)
    with temporary_settings(updates={PREFECT_API_URL: own}):
        assert ephemeral_mode()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert not ephemeral_mode()  # a real server: its global concurrency limit, reaped leases
    monkeypatch.delenv(OWN_SERVER_ENV)
    with temporary_settings(updates={PREFECT_API_URL: own}):
        assert not ephemeral_mode()


def test_a_ctrl_c_as_the_server_is_forked_leaves_its_pid_watched_and_stops_the_run(monkeypatch):
    # Seen in CI: the signal landed on another thread while the main thread masked it, the handler's exception
    # left Popen after its fork, and the server, watched by nobody, outlived the run.
    import os
    import signal
    import threading

    import flows.ephemeral as ephemeral
    import memfit.runtime.procs as procs

    watched: list[int] = []

    class Reaper:
        def watch(self, pid: int) -> None:
            watched.append(pid)

    class Forked:
        pid = 4242

        def __init__(self, *args, **kwargs) -> None:
            go.set()
            sent.wait(10)
            sum(range(10_000))  # the handler, were it not deferred, runs in here: Popen never returns

        def poll(self) -> int:
            return 0

    def stop(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(procs, "Reaper", Reaper)
    monkeypatch.setattr(ephemeral.subprocess, "Popen", Forked)
    monkeypatch.setattr(ephemeral.atexit, "register", lambda fn: fn)
    for key in ("PREFECT_API_URL", OWN_SERVER_ENV, "PREFECT_UI_URL"):
        monkeypatch.delenv(key, raising=False)
    # A thread started before the fork's mask, as the exit guard's relay is: the kernel hands it the signal.
    go, sent = threading.Event(), threading.Event()

    def send() -> None:
        go.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        sent.set()

    sender = threading.Thread(target=send)
    sender.start()
    previous = signal.signal(signal.SIGINT, stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            ephemeral.EphemeralServer()
    finally:
        sender.join()
        signal.signal(signal.SIGINT, previous)
    assert watched == [Forked.pid]  # the reaper knows the server, so it ends with the run
