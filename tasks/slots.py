"""The training slot a run holds while it trains, so two runs on one machine never share a GPU."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from tqdm.auto import tqdm

from memfit.config import MemfitConfig
from memfit.runtime.slots import machine_slot

log = logging.getLogger("memfit.runtime.slots")
LEASE_SECONDS = 60  # a server reaps a dead holder's lease after this; renewed in the background while training


def ephemeral_mode() -> bool:
    """No PREFECT_API_URL, or the one `memfit run` set to the ephemeral server it started (flows/ephemeral.py):
    a server that runs no lease reaper."""
    from prefect.settings import PREFECT_API_URL

    from flows.ephemeral import OWN_SERVER_ENV

    url = PREFECT_API_URL.value()
    return not url or url == os.environ.get(OWN_SERVER_ENV)


def slots_folder() -> Path:
    """Beside the Prefect database the ephemeral server uses: the same scope a global limit had there."""
    from prefect.settings import PREFECT_HOME

    return Path(PREFECT_HOME.value()) / "memfit-slots"


@contextmanager
def training_slot(config: MemfitConfig) -> Iterator[None]:
    """Hold a training slot for the block, waiting (and saying so) while every slot is taken.

    Default mode: a file lock in the Prefect home, freed by the kernel when its holder dies, so a SIGKILLed run
    never blocks the next one. With a Prefect server: its global concurrency limit, whose 60 s lease the
    server reaps after a holder dies.
    """
    key, slots = config.deploy.concurrency_key, config.deploy.training_slots
    notify = _WaitNotice(key)
    with ExitStack() as stack:
        stack.callback(notify.close)
        if ephemeral_mode():
            stack.enter_context(machine_slot(slots_folder(), key, slots, run=config.run.name, notify=notify))
        else:
            ensure_training_slots(key, slots)
            quiet_expected_timeouts()
            start, wait = time.monotonic(), 5.0
            while True:
                try:
                    stack.enter_context(concurrency(key, occupy=1, lease_duration=LEASE_SECONDS,
                                                    timeout_seconds=wait))
                    break
                except TimeoutError:
                    notify(_server_wait_line(key, time.monotonic() - start))
                    wait = 30.0
        notify.close()  # the slot is ours: the waiting line gives way to training's own progress line
        yield


class _WaitNotice:
    """A wait is said in the log (the terminal, the Prefect UI) and, on a terminal, in a progress line."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.bar: Any = None

    def __call__(self, line: str) -> None:
        log.warning(line)
        if self.bar is None:
            self.bar = tqdm(total=None, desc=f"waiting for a training slot ({self.key})",
                            bar_format="{desc}: {elapsed}", disable=None, leave=False)
        self.bar.update(0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _ExpectedTimeouts(logging.Filter):
    """Drops Prefect's ERROR line for a slot acquisition that timed out: memfit asks with a timeout on purpose (to
    say what it waits for, every 30 s) and says so itself; an ERROR for a normal wait sent users looking for a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("ConcurrencySlotAcquisition" in text and "raised TimeoutError" in text)


_QUIET = _ExpectedTimeouts()


def quiet_expected_timeouts() -> None:
    """Once per process (idempotent): the filter stays, as the service logs on its own thread after the wait."""
    logger = logging.getLogger("prefect._internal.concurrency")
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)


def _server_wait_line(key: str, waited: float) -> str:
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(key)
        held = f"{limit.active_slots}/{limit.limit} slot(s) in use"
    except Exception:  # noqa: BLE001 - the line is what matters, not the figures
        held = "every slot in use"
    return (f"waiting {waited:.0f} s for a training slot: Prefect concurrency limit {key!r} has {held}; a run "
            f"killed while training frees its slot when its {LEASE_SECONDS} s lease expires and the server reaps "
            f"it. To free it by hand: prefect gcl update {key} --active-slots 0")


def ensure_training_slots(name: str, slots: int) -> None:
    """Create the limit on first use (an absent limit would silently not limit anything)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
            except Exception:  # noqa: BLE001 - created concurrently by another run: fine
                client.read_global_concurrency_limit_by_name(name)
