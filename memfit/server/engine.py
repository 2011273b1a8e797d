"""The request queue (bounded) and the one generation thread that batches what waits in it."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit.server.backends import Sampling
from memfit.server.background import BackgroundLoop
from memfit.server.logprobs import score
from memfit.server.protocol import RequestError

log = logging.getLogger("memfit.server")
# Bytes of a character cut in two by byte-level BPE decode to U+FFFD: hold them back until the rest arrives.
_PARTIAL = "\ufffd"


@dataclass
class Job:
    """One request's generation: filled in by the generation thread, read by the request's handler."""

    prompt_ids: list[int]
    max_new: int
    sampling: Sampling
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already sent as deltas
    finish: str | None = None
    model_id: str | None = None
    cancelled: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    top: int | None = None  # logprobs wanted with this many alternatives per position; None: no logprobs
    score_from: int = 0  # the first position scored: 0 with echo (the prompt too), else the first generated one
    scored: list = field(default_factory=list)  # logprobs.Scored per position not already sent with a delta
    stream: bool = False  # logprobs go out with each event (start, delta, end), not only at the end
    scored_to: int = 0  # positions before this one are scored (set from score_from)

    def __post_init__(self) -> None:
        self.scored_to = self.score_from
        if self.max_new == 0:  # echo with max_tokens 0: only the prompt is scored
            self.finish = "length"

    @property
    def done(self) -> bool:
        return self.finish is not None or self.cancelled

    def push(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine(BackgroundLoop):
    """Jobs go into a bounded queue; one thread takes up to max_batch of them (same sampling) and generates."""

    def __init__(self, holder: Any, max_batch: int, max_queue: int, wait_ms: float, metrics: Any = None):
        super().__init__("memfit-generate", join_s=30)
        self.holder, self.max_batch, self.wait_s, self.metrics = holder, max_batch, wait_ms / 1000, metrics
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.held: deque[Job] = deque()  # taken from the queue but not batchable with the last batch

    def depth(self) -> int:
        return self.queue.qsize() + len(self.held)

    def submit(self, job: Job) -> None:
        """Queue the job, or RequestError 503 when the queue is full (the client may retry)."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise RequestError(503, f"the server is busy: {self.queue.maxsize} requests are waiting "
                                    "(serve.max_queue); retry shortly", code="server_busy") from None

    def _next(self, timeout: float | None) -> Job | None:
        if self.held:
            return self.held.popleft()
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _batch(self) -> list[Job]:
        first = self._next(timeout=0.2)
        if first is None:
            return []
        batch, aside = [first], []
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.max_batch:
            job = self._next(timeout=max(0.0, deadline - time.monotonic()))
            if job is None:
                break
            (batch if job.sampling == first.sampling else aside).append(job)
        self.held.extend(aside)
        return [j for j in batch if not j.cancelled]

    def _run(self) -> None:
        while not self.stopping.is_set():
            batch = self._batch()
            if batch:
                self.run_batch(batch)

    def run_batch(self, batch: list[Job]) -> None:
        """Generate for `batch` on the model serving now (a swap during the batch affects only later batches)."""
        served = self.holder.current
        try:
            for job in batch:
                job.model_id = served.model_id
                # A stream's echoed prompt is its first chunk: the prompt's scores go with it.
                job.push(("start", served.model_id, self._live(served, job, len(job.prompt_ids))))
            most = max(j.max_new for j in batch)
            if most:
                served.backend.generate([j.prompt_ids for j in batch], most, batch[0].sampling,
                                        lambda step: self._step(served, batch, step), lambda: [j.done for j in batch])
            for job in batch:
                if job.finish is None:
                    job.finish = "length"
                    self._flush(job, served, final=True)
                # Whatever no delta carried: all of it without stream; with stream the tokens after the last delta
                # (ones whose text a stop string cut, or with no text of their own).
                job.scored = self._score(served, job)
        except Exception as err:  # noqa: BLE001 - a failed batch answers its requests; the server keeps serving
            log.exception("generation failed for a batch of %d on %s", len(batch), served.model_id)
            for job in batch:  # finished ones too: none has had its end (and scores), each waits for an event
                if not job.cancelled:
                    job.finish = "error"
                    job.push(("error", f"generation failed on {served.model_id}: {type(err).__name__}: {err}"))
            return
        for job in batch:
            job.push(("end", job.finish, job.scored))

    @staticmethod
    def _score(served: Any, job: Job, upto: int | None = None) -> list:
        """The positions from job.scored_to to `upto` (default: the whole sequence so far), from one forward pass
        over the sequence up to there (no sampling temperature: the model's own distribution); in this thread, so
        the backend never runs two batches at once."""
        ids = (job.prompt_ids + job.tokens)[:upto]
        if job.top is None or job.cancelled or job.scored_to >= len(ids):
            return []
        logits = served.backend.logits(np.array([ids]))[0]
        out = score(logits, ids, job.scored_to, job.top or 0)
        job.scored_to = len(ids)
        return out

    def _live(self, served: Any, job: Job, upto: int | None = None) -> list:
        """A stream's scores so far, to go with the event pushed now; nothing for a request answered at the end,
        which is scored in one pass there. A stream pays one pass per chunk (prefixes of the same sequence, so
        the numbers match that one pass within float rounding)."""
        return self._score(served, job, upto) if job.stream else []

    def _step(self, served: Any, batch: list[Job], step: list[int]) -> None:
        for job, tok in zip(batch, step, strict=True):
            if job.done:
                continue
            if served.eos_id is not None and tok == served.eos_id:
                job.finish = "stop"
                self._flush(job, served, final=True)
                continue
            job.tokens.append(tok)
            if len(job.tokens) >= job.max_new:
                job.finish = "length"
            self._flush(job, served, final=job.finish is not None)

    def _flush(self, job: Job, served: Any, final: bool) -> None:
        """Decode what is new, cut at a stop string, and send the part no later token can change."""
        job.text = served.tokenizer.decode(job.tokens, skip_special_tokens=True)
        ready = len(job.text)
        for stop in job.stops:
            at = job.text.find(stop, max(0, job.sent - len(stop)))
            if at != -1:
                job.text, job.finish, ready, final = job.text[:at], "stop", at, True
        if not final:
            ready = len(job.text.rstrip(_PARTIAL))
            # A stop string may be forming at the end: keep back as many characters as the longest one.
            ready = max(job.sent, ready - max((len(s) - 1 for s in job.stops), default=0))
        if ready > job.sent:
            # The tokens since the last delta, though a stop string being held back may leave part of the last
            # one's text for the next delta.
            job.push(("delta", job.text[job.sent:ready], self._live(served, job)))
            job.sent = ready
