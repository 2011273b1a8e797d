"""`memfit serve`'s runner: on SIGTERM (a spot notice, a stop) its flow runs save and end Preempted, not Cancelled."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from prefect.runner import Runner


class DrainingRunner(Runner):
    """Prefect's Runner, except on SIGTERM: Prefect's cancels every flow run in flight (state Cancelled, which
    nothing restarts). This one stops taking runs, passes the SIGTERM on to each flow run's process group (memfit
    commits a training checkpoint and the run ends Preempted, which the restart automation follows), waits for
    them within the drain deadline, then leaves."""

    drain_seconds: float = 60.0

    def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
        if not self.started or self.stopping or self._loop is None:
            sys.exit(0)
        self._logger.info("SIGTERM: taking no new flow runs; the runs in flight save a training checkpoint and end "
                          "Preempted (drain deadline %.0f s)", self.drain_seconds)
        self.stopping = True
        self.execute_in_background(self._drain)

    async def _drain(self) -> None:
        poller = getattr(self, "_scheduled_run_poller", None)
        if poller is not None:
            poller.stopping = True
        processes = self._process_manager
        for flow_run_id in processes.flow_run_ids():
            handle = processes.get(flow_run_id)
            if handle is not None and handle.is_alive():
                handle.graceful_kill()  # each flow run has a process group of its own: SIGTERM reaches it here
        deadline = time.monotonic() + self.drain_seconds
        while processes.flow_run_ids() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        left = processes.flow_run_ids()
        if left:  # past the deadline: as Prefect's runner would (Cancelled), rather than hang a stopping machine
            self._logger.warning("drain deadline passed with %d flow run(s) still running: cancelling", len(left))
            await self.cancel_all()
        self.started = False
        self._loops_task_group.cancel_scope.cancel()


def serve_draining(deployments: list[Any], limit: int | None, query_seconds: float, drain_seconds: float) -> None:
    """prefect.serve(*deployments) with the DrainingRunner."""
    from prefect.flows import _display_serve_start_message

    # Not paused on shutdown (prefect.serve's default): one machine leaving must not stop the others' runs.
    runner = DrainingRunner(limit=limit, query_seconds=query_seconds, pause_on_shutdown=False)
    runner.drain_seconds = drain_seconds
    for deployment in deployments:
        runner.add_deployment(deployment)
    _display_serve_start_message(*deployments)
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        pass
