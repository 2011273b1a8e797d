"""Memory limits a run hit: the measured peak of the stack that stopped, kept where the next attempt finds it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memfit.files import write_json_atomic
from memfit.memory.estimator.compose import Stack
from memfit.memory.planner.plan import MeasuredPeak

log = logging.getLogger("memfit.memory")
GB = 1e9
# At the root of the run's checkpoint store, beside its step-NNNNNNNN/ folders (the index ignores other keys):
# a restart on another machine finds it where it finds the training checkpoint it resumes from.
STORE_KEY = "memory-limits.json"
FORMAT = "memfit-memory-limits/1"
MAX_RECORDS = 32  # one per stack that stopped: a run that needs more than a few has a different problem


@dataclass(frozen=True)
class LimitRecord:
    """One stop at the memory limit: which stack ran, what it was predicted to need, what it measured, against
    which budget and threshold; `identity` ties it to the workload (model, data, train settings)."""

    identity: str
    policy: str
    kinds: tuple[str, ...]
    stack: Stack
    predicted_bytes: int
    measured_bytes: int
    step: int
    budget_bytes: int
    stop_at_fraction: float
    budget_source: str
    measure: str
    recorded_at: float

    def key(self) -> tuple:
        return self.identity, self.stack, self.kinds

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kinds"], d["stack"] = list(self.kinds), asdict(self.stack)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LimitRecord:
        """A record as written by to_dict; KeyError, TypeError or ValueError for anything else."""
        return cls(identity=str(d["identity"]), policy=str(d["policy"]), kinds=tuple(str(k) for k in d["kinds"]),
                   stack=Stack(**d["stack"]), predicted_bytes=int(d["predicted_bytes"]),
                   measured_bytes=int(d["measured_bytes"]), step=int(d["step"]), budget_bytes=int(d["budget_bytes"]),
                   stop_at_fraction=float(d["stop_at_fraction"]), budget_source=str(d["budget_source"]),
                   measure=str(d["measure"]), recorded_at=float(d["recorded_at"]))


def planned_stack(plan: Any) -> tuple[Stack, tuple[str, ...]]:
    """The stack and per-block kinds a PlanReport trained, as the planner's estimates name them (to match)."""
    stack = Stack(plan.precision, plan.micro_batch_size, plan.grad_accum_steps, bool(plan.lora),
                  quantize=plan.quantize if plan.lora else "none", loss=plan.loss or "plain",
                  optimizer=plan.optimizer or "adamw", optimizer_in_backward=bool(plan.optimizer_in_backward),
                  lean_layers=bool(plan.lean_layers))
    return stack, tuple(plan.block_kinds or ())


def record_from(plan: Any, reading: dict[str, Any], identity: str, stop_at_fraction: float, now: float
                ) -> LimitRecord:
    """The record of a stop: the plan that ran (a PlanReport) and the monitor's reading that stopped it."""
    stack, kinds = planned_stack(plan)
    return LimitRecord(identity=identity, policy=plan.policy, kinds=kinds, stack=stack,
                       predicted_bytes=int(plan.predicted_peak_bytes or 0), measured_bytes=int(reading["peak_bytes"]),
                       step=int(reading["step"]), budget_bytes=int(reading["budget_bytes"] or 0),
                       stop_at_fraction=float(stop_at_fraction), budget_source=str(reading.get("budget_source", "")),
                       measure=str(reading.get("measure", "")), recorded_at=float(now))


def merge(records: Iterable[LimitRecord], new: Iterable[LimitRecord]) -> list[LimitRecord]:
    """Both lists as one, a stack's newest record winning, oldest first, at most MAX_RECORDS."""
    by_key: dict[tuple, LimitRecord] = {}
    for r in [*records, *new]:
        if r.key() not in by_key or r.recorded_at >= by_key[r.key()].recorded_at:
            by_key[r.key()] = r
    return sorted(by_key.values(), key=lambda r: r.recorded_at)[-MAX_RECORDS:]


def to_payload(records: Sequence[LimitRecord]) -> dict[str, Any]:
    return {"format": FORMAT, "records": [r.to_dict() for r in records]}


def from_payload(payload: Any, where: str) -> list[LimitRecord]:
    """The records of a memory-limits document; one that is not one is ignored with a warning (never an error:
    it only makes a restart plan from estimates, as a first attempt does)."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        log.warning("ignoring %s: not a %s document", where, FORMAT)
        return []
    out = []
    for d in payload.get("records") or []:
        try:
            out.append(LimitRecord.from_dict(d))
        except (KeyError, TypeError, ValueError) as err:
            log.warning("ignoring a record in %s (%s: %s)", where, type(err).__name__, err)
    return out


def current_limit(record: LimitRecord, budget_gb: float | None, stop_at_fraction: float | None) -> tuple[int, str]:
    """The limit the record's measured peak must stay under with the config as it is now: the monitor's stop
    threshold (monitor.stop_at_fraction, 1.0 when unset: the budget itself) of memory.budget_gb when that set the
    budget it was measured against, else of that budget; and where the figure comes from."""
    fraction = 1.0 if stop_at_fraction is None else stop_at_fraction
    if budget_gb is not None and record.budget_source == "memory.budget_gb":
        budget, source = int(budget_gb * GB), "memory.budget_gb"
    else:
        budget, source = record.budget_bytes, record.budget_source or "the budget"
    return int(budget * fraction), f"monitor.stop_at_fraction={fraction:g} of {budget / GB:.4g} GB {source}"


def measured_peaks(records: Iterable[LimitRecord], identity: str, budget_gb: float | None,
                   stop_at_fraction: float | None) -> list[MeasuredPeak]:
    """What the planner must respect: this workload's records whose measured peak is still over the limit (a
    budget raised since, or a higher stop fraction, lets that stack fit again)."""
    out = []
    for r in records:
        if r.identity != identity:
            continue
        limit, source = current_limit(r, budget_gb, stop_at_fraction)
        if r.measured_bytes > limit:
            out.append(MeasuredPeak(stack=r.stack, kinds=r.kinds, predicted_bytes=r.predicted_bytes,
                                    measured_bytes=r.measured_bytes, step=r.step, limit_bytes=limit,
                                    limit_source=source))
    return out


# -- at the edges: reading and writing the two copies ----------------------------------------------------------
def local_path(work_dir: str | Path, run_key: str) -> Path:
    """The local plan cache's copy, per logical run (runtime.recovery.run_key)."""
    return Path(work_dir) / "plan-cache" / "memory-limits" / f"{run_key}.json"


def load(store: Any, local: Path) -> list[LimitRecord]:
    """Both copies merged: the checkpoint store's (any machine's stops) and this machine's plan cache."""
    from memfit.storage.base import KeyNotFound

    found: list[LimitRecord] = []
    try:
        found = from_payload(json.loads(store.get_bytes(STORE_KEY)), f"{store.uri}/{STORE_KEY}")
    except KeyNotFound:
        pass
    except Exception as err:  # noqa: BLE001 - an unreachable store is the resume's error to report, not this one's
        log.warning("could not read %s/%s (%s); using the local plan cache only", store.uri, STORE_KEY, err)
    if local.is_file():
        try:
            found = merge(found, from_payload(json.loads(local.read_text()), str(local)))
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s (%s)", local, err)
    return found


def save(store: Any, local: Path, record: LimitRecord) -> list[str]:
    """Add `record` to both copies, each replaced whole (the store's put is atomic, the local file is renamed
    into place); returns where it was written. A copy that cannot be written is a warning: the run is stopping
    already, and the other copy (or a person reading the message) still has the figure."""
    written = []
    records = merge(load(store, local), [record])
    try:
        store.put_bytes(STORE_KEY, json.dumps(to_payload(records), indent=1).encode())
        written.append(f"{store.uri.rstrip('/')}/{STORE_KEY}")
    except Exception as err:  # noqa: BLE001 - S3 errors, a read-only folder: said, not raised
        log.warning("could not record the memory limit in %s/%s (%s)", store.uri, STORE_KEY, err)
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(local, to_payload(records), indent=1)
        written.append(str(local))
    except OSError as err:
        log.warning("could not record the memory limit in %s (%s)", local, err)
    return written
