"""`memfit serve`'s runner: a spot notice or SIGTERM drains the machine — no new claim, then save, end Preempted."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect.runner import Runner

from memfit.runtime.recovery import DRAIN_DEADLINE_MESSAGE, PREEMPTED

log = logging.getLogger("memfit.recovery")


class DrainingRunner(Runner):
    """Prefect's Runner, except when the machine is going away. Prefect's runner, on SIGTERM, cancels every flow
    run in flight (Cancelled, which nothing restarts), and goes on polling until it does. This one, from the moment
    of the notice (SIGTERM, or a spot notice its watcher sees):

    1. claims nothing: polling stops, a run claimed by a poll already under way is handed back (Scheduled again,
       for another machine), and one whose claim lands after the notice is never started;
    2. passes SIGTERM to each flow run it started (memfit commits a training checkpoint, the run ends Preempted,
       which the restart automation follows), also to one that started a moment after the notice;
    3. waits for them within the drain deadline; a run still alive then is ended Preempted by the runner itself
       (the newest training checkpoint stands) and killed, never Cancelled; then it leaves.
    """

    drain_seconds: float = 60.0
    draining_since: float | None = None  # time.monotonic() of the notice
    drain_reason: str = ""

    # -- 1. no new claim ----------------------------------------------------------------------------------------
    async def __aenter__(self) -> Any:
        entered = await super().__aenter__()
        self._guard_claims()
        if self.draining_since is not None:  # the notice came while the runner was starting
            self.draining_since = None
            self.begin_drain(self.drain_reason)
        return entered

    def _guard_claims(self) -> None:
        """Every claim goes through the state proposer's Scheduled → Pending: a draining machine makes none, and
        gives back one that a poll already under way at the notice made."""
        proposer = self._state_proposer
        claim = proposer.propose_pending

        async def propose_pending_unless_draining(flow_run: Any) -> bool:
            if self.draining_since is not None:
                self._logger.info("draining: flow run '%s' left Scheduled for another machine", flow_run.name)
                return False
            claimed = await claim(flow_run)
            if claimed and self.draining_since is not None:
                await self._hand_back(flow_run)
                return False
            return claimed

        proposer.propose_pending = propose_pending_unless_draining

    async def _hand_back(self, flow_run: Any) -> None:
        from prefect.states import Scheduled

        try:
            await self._client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
            self._logger.info("draining: flow run '%s' claimed as the notice came, handed back (Scheduled) for "
                              "another machine", flow_run.name)
        except Exception:  # noqa: BLE001 - it then stays Pending here; the silence window marks it Crashed
            self._logger.exception("draining: could not hand flow run '%s' back", flow_run.name)

    def begin_drain(self, reason: str) -> None:
        """The notice: stop claiming at once (this runs in a signal handler or the spot watcher's thread), then
        drain on the runner's loop."""
        if self.draining_since is not None:
            return
        self.draining_since, self.drain_reason = time.monotonic(), reason
        if not self.started or self._loop is None:
            return  # not started yet: __aenter__ drains as soon as it has its loop
        self.stopping = True
        poller = getattr(self, "_scheduled_run_poller", None)
        if poller is not None:
            poller.stopping = True  # the poll loop asks this before every query
        # No log line here: this may run in the SIGTERM handler, and a handler that logs can wait for ever on the
        # lock of the record the interrupted loop was writing (memfit/runtime/signal_relay.py). _drain says it.
        self.execute_in_background(self._drain)

    def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
        if not self.started or self._loop is None:
            sys.exit(0)
        self.begin_drain("SIGTERM")

    # -- 2, 3. save, end Preempted, leave ----------------------------------------------------------------------
    async def _drain(self) -> None:
        self._logger.info("%s: draining — taking no new flow runs; the runs in flight save a training checkpoint "
                          "and end Preempted (drain deadline %.0f s)", self.drain_reason, self.drain_seconds)
        processes, signalled = self._process_manager, set()
        deadline = (self.draining_since or time.monotonic()) + self.drain_seconds
        while time.monotonic() < deadline:
            for flow_run_id in processes.flow_run_ids():
                handle = processes.get(flow_run_id)
                if flow_run_id not in signalled and handle is not None and handle.is_alive():
                    handle.graceful_kill()  # the flow run's process: SIGTERM, then memfit saves and ends Preempted
                    signalled.add(flow_run_id)
            if not processes.flow_run_ids():
                break
            await asyncio.sleep(0.25)
        left = processes.flow_run_ids()
        if left:
            self._logger.warning("drain deadline (%.0f s) passed with %d flow run(s) still running: ending them "
                                 "Preempted, not Cancelled, so recovery restarts them", self.drain_seconds, len(left))
            for flow_run_id in left:
                await self._end_preempted(flow_run_id)
        self._logger.info("drained in %.1f s after %s", time.monotonic() - (self.draining_since or 0.0),
                          self.drain_reason)
        self.started = False
        self._loops_task_group.cancel_scope.cancel()

    async def _end_preempted(self, flow_run_id: Any) -> None:
        """The state first (a final state: the runner's own Crashed proposal after the kill is then refused, so the
        restart automation fires once), then the kill."""
        from prefect.states import Failed

        message = DRAIN_DEADLINE_MESSAGE.format(seconds=self.drain_seconds, reason=self.drain_reason)
        try:
            await self._client.set_flow_run_state(flow_run_id, Failed(name=PREEMPTED, message=message), force=True)
        except Exception:  # noqa: BLE001 - killed all the same: Prefect then reports it Crashed (restartable too)
            self._logger.exception("could not end flow run %s Preempted", flow_run_id)
        handle = self._process_manager.get(flow_run_id)
        if handle is not None:
            handle.hard_kill()


def watch_spot_notices(runner: DrainingRunner, spot_cfg: Any) -> Callable[[], None]:
    """With the spot watcher on (checkpoint.spot / $MEMFIT_SPOT_WATCHER), this machine's metadata service is polled
    here too: an interruption notice (or a rebalance with on_rebalance: stop) drains the runner before the flow run
    it holds has saved, so the restart that follows is never claimed on the machine being taken away."""
    from memfit.runtime.preemption import StopFlag
    from memfit.runtime.spot import SpotWatcher, resolve_settings

    settings = resolve_settings(spot_cfg)
    if not settings.enabled:
        return lambda: None
    notice, closed = StopFlag(), threading.Event()
    watcher = SpotWatcher(settings, notice).start()
    log.info("spot watcher on for this machine's runner: polling %s every %.1f s", settings.base_url,
             settings.poll_seconds)

    def drain_on_notice() -> None:
        notice.wait()
        if not closed.is_set():
            runner.begin_drain(notice.reason or "spot notice")

    threading.Thread(target=drain_on_notice, name="memfit-runner-drain", daemon=True).start()

    def close() -> None:
        closed.set()
        watcher.close()
        notice.set()  # lets the waiting thread end without draining

    return close


def serve_draining(deployments: list[Any], limit: int | None, query_seconds: float, drain_seconds: float,
                   spot_cfg: Any = None) -> None:
    """prefect.serve(*deployments) with the DrainingRunner."""
    from prefect.flows import _display_serve_start_message

    # Not paused on shutdown (prefect.serve's default): one machine leaving must not stop the others' runs.
    runner = DrainingRunner(limit=limit, query_seconds=query_seconds, pause_on_shutdown=False)
    runner.drain_seconds = drain_seconds
    for deployment in deployments:
        runner.add_deployment(deployment)
    close_watcher = watch_spot_notices(runner, spot_cfg) if spot_cfg is not None else (lambda: None)
    _display_serve_start_message(*deployments)
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        pass
    finally:
        close_watcher()
