"""Phase 2's plan reused when nothing it depends on changed: keyed on its inputs, memfit's code and versions."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.files import write_json_atomic
from memfit.reports import PlanReport
from memfit.runtime.env import package_version

log = logging.getLogger("memfit.memory")
_PACKAGE = Path(__file__).resolve().parents[2]  # memfit/
# What the estimator traces on fake tensors besides memfit's own code: the model classes and the LoRA layers.
_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")


@functools.cache
def code_fingerprint() -> str:
    """A hash of every memfit source file and the versions of the libraries the estimate runs through: an edit
    to the estimator, the planner or a policy (or an upgrade) is a new key, not a stale plan."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in _LIBRARIES:
        h.update(f"{name}={package_version(name) or '-'}\0".encode())
    return h.hexdigest()


def plan_key(cfg: Any, profile: Any, budget: int | None, source: str, architecture: dict[str, Any],
             measured: Sequence[Any] = ()) -> str:
    """The whole resolved config (what the plan reads is spread over most of it), the target device's profile,
    the budget and where it came from, the model's architecture, the code fingerprint, and the peaks measured
    at the memory limit (a stop makes the next plan a new one, never the cached plan that stopped)."""
    parts = {"config": cfg.model_dump(mode="json"), "profile": asdict(profile), "budget": budget, "source": source,
             "architecture": architecture, "code": code_fingerprint()}
    if measured:
        parts["measured"] = [asdict(m) for m in measured]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_path(work_dir: str | Path, key: str) -> Path:
    return Path(work_dir) / "plan-cache" / f"{key}.json"


def load_plan(path: Path) -> PlanReport | None:
    """The cached report, or None when there is none; an unreadable one is ignored with a warning."""
    if not path.is_file():
        return None
    try:
        report = PlanReport.model_validate_json(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("ignoring unreadable plan cache %s (%s); planning again", path, err)
        return None
    log.info("memory plan from cache %s (same config, device, architecture and code)", path)
    return report


def store_plan(path: Path, report: PlanReport) -> None:
    """Written whole or not at all; a plan that does not fit is never stored (it ends the run or warns)."""
    if not report.fits:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, report.model_dump(mode="json"))
    except OSError as err:  # a cache that cannot be written costs the next run the plan's seconds, no more
        log.warning("could not write the plan cache %s (%s)", path, err)
