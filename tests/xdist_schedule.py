"""The suite's pytest-xdist scheduler: test files as units, the longest first, and a crashed worker's files resumed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def scheduler(config: Any, log: Any, timed_files: frozenset[str], longest_first: Sequence[str]) -> Any:
    """LoadFileScheduling with the files in `timed_files` as one unit ("timed"), the units in `longest_first`
    handed out first, and a crash that fails its test once and lets the rest of the run go on."""
    from xdist.scheduler import LoadFileScheduling

    class TimedFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "timed" if path in timed_files else path

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_longest_first", False):  # once, when the queue is complete
                self._longest_first = True
                rank = {scope: i for i, scope in enumerate(longest_first)}
                tier = {"e2e": 0, "integration": 1, "unit": 2}  # then e2e, integration, and unit files to fill in
                units = sorted(self.workqueue.items(), key=lambda kv: (  # stable: xdist's order within a tier
                    rank.get(kv[0], len(rank)), tier.get(kv[0].split("/")[1] if "/" in kv[0] else "", 3)))
                self.workqueue.clear()
                self.workqueue.update(units)
            # A crashed worker's files come back whole, those it had finished too: sent to a worker they would be an
            # empty assignment, after which nothing ever asks the scheduler again, and the run hangs (pytest-xdist
            # 3.8, seen in CI after a llama.cpp segfault: 93 % and then nothing until the 90-minute limit).
            for scope in [s for s, unit in self.workqueue.items() if all(unit.values())]:
                del self.workqueue[scope]
            if self.workqueue:
                super()._assign_work_unit(node)

        def remove_node(self, node):
            crashed = super().remove_node(node)
            # The test that crashed its worker is reported failed once, not run again on every new worker (a crash
            # that repeats would take down one worker after another).
            for unit in self.workqueue.values():
                if crashed in unit:
                    unit[crashed] = True
            return crashed

    return TimedFilesTogether(config, log)
