"""Forked worker processes mapping a function over jobs, results taken in order, a bounded number in flight."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from memfit.errors import DataError


def in_order(work: Callable[[Any], Any], jobs: Iterable[Any], num_proc: int, sink: Callable[[Any], None]) -> None:
    """sink(work(job)) for every job, in the jobs' order: in this process, or in num_proc forked workers that
    inherit what the parent set up (a tokenizer); at most 4 x num_proc jobs are in flight, so the parent's memory
    stays flat however many jobs there are. A worker's exception is raised here, the first in job order; a worker
    that dies is an error, never a wait. Fewer jobs than num_proc take fewer workers, and a single job runs here:
    a small corpus forks nothing."""
    jobs = iter(jobs)
    ahead = list(itertools.islice(jobs, num_proc))  # as many jobs as workers: are there enough to share?
    if num_proc <= 1 or len(ahead) <= 1:
        for job in itertools.chain(ahead, jobs):
            sink(work(job))
        return
    num_proc = min(num_proc, len(ahead))
    jobs = itertools.chain(ahead, jobs)
    # concurrent.futures rather than multiprocessing.Pool: Pool.terminate can hang for good when its task thread is
    # blocked writing a large job into a pipe no worker reads any more (seen once here, under load, on a bad
    # record), and a Pool whose worker died waits for its result forever; the executor reports both as errors.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("fork"), initializer=quiet_signals)
    pending: deque[Future[Any]] = deque()
    try:
        for job in jobs:
            pending.append(pool.submit(work, job))
            if len(pending) >= 4 * num_proc:
                sink(_result(pending.popleft()))
        while pending:
            sink(_result(pending.popleft()))
    except Exception:
        # a bad record (from a worker or the reader): the jobs in flight finish (a few slices), then all is closed
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    except BaseException:  # a stop (Ctrl-C, the run's termination): the workers go now
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _result(future: Future[Any]) -> Any:
    try:
        return future.result()
    except BrokenProcessPool:
        raise DataError("data.num_proc: a data preparation worker died (killed, or out of memory?); lower "
                        "data.num_proc, or set it to 1 to prepare in this process") from None


def quiet_signals() -> None:
    """A worker is the parent's helper: it dies on SIGTERM without running the handlers it inherited, and leaves
    Ctrl-C to the parent. The inherited wakeup fd goes first: it is the parent's pipe, and a signal to a worker
    written there reads, in the parent, as a stop of the run (runtime/termination.py)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def num_proc(data: Any) -> int:
    """data.num_proc, or the cores this process may run on."""
    if data.num_proc:
        return int(data.num_proc)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
