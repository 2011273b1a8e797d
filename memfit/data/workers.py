"""Forked worker processes mapping a function over jobs, results taken in order through a bounded queue."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


def in_order(work: Callable[[Any], Any], jobs: Iterable[Any], num_proc: int, sink: Callable[[Any], None]) -> None:
    """sink(work(job)) for every job, in the jobs' order: in this process, or in num_proc forked workers that
    inherit what the parent set up (a tokenizer); at most 4 x num_proc jobs are in flight, so the parent's memory
    stays flat however many jobs there are. A worker's exception is raised here, the first in job order."""
    if num_proc <= 1:
        for job in jobs:
            sink(work(job))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = multiprocessing.get_context("fork").Pool(num_proc, initializer=quiet_signals)
    try:
        pending: deque[Any] = deque()
        for job in jobs:
            pending.append(pool.apply_async(work, (job,)))
            if len(pending) >= 4 * num_proc:
                sink(pending.popleft().get())
        while pending:
            sink(pending.popleft().get())
        pool.close()  # workers leave when the queue is done: no signal is sent on success
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def quiet_signals() -> None:
    """A worker is the parent's helper: it dies on SIGTERM without running the handlers it inherited, and leaves
    Ctrl-C to the parent. The inherited wakeup fd goes first: it is the parent's pipe, and a signal to a worker
    written there reads, in the parent, as a stop of the run (runtime/termination.py)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
