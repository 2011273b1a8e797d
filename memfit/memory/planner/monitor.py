"""Memory during training: readings every N steps, one warning before the limit, a clean stop at a hard limit."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from memfit.errors import MemoryLimitError
from memfit.memory.estimator.timeline import LiveBytes

log = logging.getLogger("memfit.memory")

GB = 1e9
WARNING_EVENT = "memfit.memory.warning"
LIMIT_EVENT = "memfit.memory.limit"
# What the stop message tells a person to do, by recovery.on_memory_limit.
STOP_ADVICE = "run the same command with --set memory.policy=full (or a policy that fits) to resume from it"
LEANER_ADVICE = ("run the same command again to resume from it with a leaner stack (recovery.on_memory_limit="
                 "leaner: the planner rules this stack out by its measured peak)")

# Callables that receive each warning/limit event (a dict); the Prefect task layer adds one that emits a
# Prefect event, so memfit itself never imports prefect.
_SINKS: list[Callable[[dict[str, Any]], None]] = []


@contextlib.contextmanager
def event_sink(fn: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Send memory events to `fn` while the block runs (e.g. `prefect.events.emit_event`)."""
    _SINKS.append(fn)
    try:
        yield
    finally:
        _SINKS.remove(fn)


@dataclass(frozen=True)
class Budget:
    """The memory the run may use, where that number comes from, and which measured figure it limits."""

    bytes: int | None
    source: str
    measure: str  # the reading compared with it: tensor_peak, allocated_peak, reserved_peak, rss


def resolve_budget(budget_gb: float | None, device: torch.device, track_tensors: bool = True) -> Budget:
    """memory.budget_gb limits what the probe and planner estimate (tensor bytes on CPU, CUDA allocated);
    without it the device's own memory limits what the process physically holds (CUDA reserved, RSS)."""
    if budget_gb is not None:
        if device.type == "cuda":
            return Budget(int(budget_gb * GB), "memory.budget_gb", "allocated_peak")
        return Budget(int(budget_gb * GB), "memory.budget_gb", "tensor_peak" if track_tensors else "rss_delta")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Budget(int(total), f"memory of {torch.cuda.get_device_name(device)}", "reserved_peak")
    limit = _cgroup_limit()
    total = int(psutil.virtual_memory().total)
    if limit is not None and limit < total:  # a container's limit is the one the OOM killer enforces
        return Budget(limit, "the container's memory limit (cgroup)", "rss")
    return Budget(total, "host RAM", "rss")


def _cgroup_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, v1 limit_in_bytes), if any."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            raw = Path(root, name).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # "max" or a huge v1 number: no limit
            return int(raw)
    return None


@dataclass
class MemoryReading:
    """One reading; `peak_bytes` is the figure compared with the budget (see `measure`)."""

    step: int
    peak_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    rss_bytes: int
    measure: str
    budget_bytes: int | None
    device_used_bytes: int | None = None

    @property
    def fraction(self) -> float | None:
        return self.peak_bytes / self.budget_bytes if self.budget_bytes else None

    def metrics(self) -> dict[str, float]:
        out = {"memory/peak_bytes": self.peak_bytes, "memory/allocated_bytes": self.allocated_bytes,
               "memory/reserved_bytes": self.reserved_bytes, "memory/rss_bytes": self.rss_bytes}
        if self.fraction is not None:
            out["memory/budget_fraction"] = round(self.fraction, 6)
        if self.device_used_bytes is not None:
            out["memory/device_used_bytes"] = self.device_used_bytes
        return out


def _nvml_used(device: torch.device) -> int | None:
    """Memory in use on the whole GPU (all processes, CUDA context included): NVML when present."""
    try:
        # torch maps the index through CUDA_VISIBLE_DEVICES to NVML's (cuda:0 may be physical GPU 3).
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # noqa: BLE001 - no NVML library or no permission: ask the CUDA runtime instead
        try:
            free, total = torch.cuda.mem_get_info(device)
            return int(total - free)
        except RuntimeError:
            return None


def held_tensors(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """The tensors an optimizer object holds in its attributes, in lists, tuples and dicts of them, and in the
    optimizers it wraps. DeepSpeed's ZeRO optimizer keeps its fp32 partition, its flat gradient partitions and its
    reduce buckets there, written in the backward or the step: a step's count that adopted only parameters,
    gradients and `state` saw them from their first write on, so a rank peaking in the forward read low."""
    found: list[torch.Tensor] = []

    def walk(x: Any, level: int) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif level <= 0:
            return
        elif isinstance(x, dict):
            for v in list(x.values()):
                walk(v, level - 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, level - 1)
        elif hasattr(x, "param_groups"):  # an optimizer, or an engine's optimizer wrapping one
            for v in list(vars(x).values()):
                walk(v, level - 1)

    walk(obj, depth)
    return found


class MemoryMonitor:
    """Watches every optimizer step of the training loop, on each rank (see `watch`); a disabled one only passes
    through."""

    def __init__(self, cfg: Any, budget: Budget, device: torch.device, tracker: Any, model: nn.Module,
                 optimizer: torch.optim.Optimizer, run_name: str = "memfit", advice: str = STOP_ADVICE) -> None:
        self.cfg, self.budget, self.device, self.tracker = cfg, budget, device, tracker
        self.model, self.optimizer, self.run_name, self.advice = model, optimizer, run_name, advice
        self.readings: list[MemoryReading] = []
        self.warned = False
        self.stop_requested = False
        self.stop_message = ""
        self.stop_reading: MemoryReading | None = None
        self.postfix: dict[str, str] = {}
        self._process = psutil.Process()
        self._rss_start = self._process.memory_info().rss
        self._cuda_peak = 0
        self._counted_peak: int | None = None  # CPU: the tensor peak of the newest counted step
        self._started = False
        self._first_step = 1  # the first step this process runs (a resumed run's is after its checkpoint's)

    @classmethod
    def for_run(cls, cfg: Any, device: torch.device, tracker: Any, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> MemoryMonitor:
        budget = resolve_budget(cfg.memory.budget_gb, device, cfg.monitor.track_tensors)
        if cfg.memory.budget_gb is None and cfg.memory.device:
            # Planned for another device (memory.device): watch against that device's usable memory too.
            from memfit.memory.planner.search import target_profile

            target = target_profile(cfg.memory)
            budget = Budget(int(target.usable_bytes), f"usable memory of a {target.name} (memory.device)",
                            "allocated_peak" if device.type == "cuda" else
                            ("tensor_peak" if cfg.monitor.track_tensors else "rss_delta"))
        advice = LEANER_ADVICE if cfg.recovery.on_memory_limit == "leaner" else STOP_ADVICE
        return cls(cfg.monitor, budget, device, tracker, model, optimizer, cfg.run.name, advice)

    # -- the per-step hook -----------------------------------------------------------------------------
    def sampled(self, step: int) -> bool:
        return step == self._first_step or step % self.cfg.every_steps == 0

    def counted(self, step: int) -> bool:
        """CPU: whether live tensor bytes are counted during this step (a TorchDispatchMode: the step is slower).
        The first two steps this process runs (from step 1: the second is the first with optimizer state) and
        every monitor.count_every_steps: with the same shapes every step reaches the same peak, so the readings
        in between report the last counted one. A resumed run counts its own first steps too: it may run a
        different stack than the run that saved the training checkpoint (a restart with a leaner stack)."""
        return step - self._first_step < 2 or step % self.cfg.count_every_steps == 0

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Wrap one optimizer step (`step` is its number once done): measure it, warn or request a stop."""
        if not self.cfg.enabled:
            yield
            return
        if not self._started:
            self._first_step, self._started = step, True
        live = self._tensor_counter() if self.counted(step) else None
        try:
            if live is not None:
                with live:
                    yield
            else:
                yield
        except torch.OutOfMemoryError as err:
            raise MemoryLimitError(
                f"out of memory at step {step} ({str(err).splitlines()[0]}); the last committed training "
                "checkpoint is kept: resume with --set memory.policy=full, or start a new run with a smaller "
                "micro-batch (memfit profile --compare none,full shows the difference); monitor.stop_at_fraction "
                "stops with a training checkpoint before this happens"
            ) from err
        if self.device.type == "cuda":
            # Cheap host-side counters, read every step; only `read` resets them (one window per reading).
            self._cuda_peak = max(self._cuda_peak, self._cuda_peak_figure())
            if not self.sampled(step) and self._needs_action(self._cuda_peak):
                self._record(step, None)
        if live is not None:
            self._counted_peak = live.peak  # the next reading reports it (steps between readings act as before)
        if self.sampled(step):
            self._record(step, live)

    def _tensor_counter(self) -> LiveBytes | None:
        if self.device.type == "cuda" or not self.cfg.track_tensors:
            return None
        live = LiveBytes(self.device)
        params = list(self.model.parameters())  # one walk of the module tree (a reading's main cost), not two
        live.adopt(params, "parameter")
        live.adopt(list(self.model.buffers()), "buffer")
        live.adopt([p.grad for p in params if p.grad is not None], "gradient")
        # getattr: an engine's optimizer (DeepSpeed ZeRO) may keep its state elsewhere.
        state = getattr(self.optimizer, "state", None) or {}
        live.adopt([v for s in state.values() if isinstance(s, dict) for v in s.values()
                    if isinstance(v, torch.Tensor)], "optimizer")
        live.adopt(held_tensors(self.optimizer), "optimizer")
        return live

    def _cuda_peak_figure(self) -> int:
        if self.budget.measure == "reserved_peak":
            return int(torch.cuda.max_memory_reserved(self.device))
        return int(torch.cuda.max_memory_allocated(self.device))

    def _needs_action(self, peak: int) -> bool:
        stop_at = self.cfg.stop_at_fraction
        return ((not self.warned and self._over(peak))
                or (stop_at is not None and not self.stop_requested and self._over(peak, stop_at)))

    def _over(self, peak: int, fraction: float | None = None) -> bool:
        limit = self.cfg.warn_fraction if fraction is None else fraction
        return self.budget.bytes is not None and peak > limit * self.budget.bytes

    # -- readings --------------------------------------------------------------------------------------
    def read(self, step: int, live: LiveBytes | None) -> MemoryReading:
        rss = int(self._process.memory_info().rss)
        if self.device.type == "cuda":
            peak, self._cuda_peak = self._cuda_peak, 0
            torch.cuda.reset_peak_memory_stats(self.device)  # the next reading's window starts here
            return MemoryReading(step=step, peak_bytes=peak, measure=self.budget.measure,
                                 allocated_bytes=int(torch.cuda.memory_allocated(self.device)),
                                 reserved_bytes=int(torch.cuda.memory_reserved(self.device)), rss_bytes=rss,
                                 budget_bytes=self.budget.bytes, device_used_bytes=_nvml_used(self.device))
        counting = self.device.type != "cuda" and self.cfg.track_tensors
        if live is not None:
            allocated = live.current
        elif counting:
            allocated = self._held_bytes()  # what lives between steps, without counting a step
        else:
            allocated = rss - self._rss_start
        if self.budget.measure == "tensor_peak" and counting:
            peak = live.peak if live is not None else max(self._counted_peak or 0, allocated)
        elif self.budget.measure == "rss_delta":
            peak = rss - self._rss_start
        else:
            peak = rss
        return MemoryReading(step=step, peak_bytes=int(peak), measure=self.budget.measure,
                             allocated_bytes=int(allocated), reserved_bytes=rss, rss_bytes=rss,
                             budget_bytes=self.budget.bytes)

    def _held_bytes(self) -> int:
        """Bytes of the parameters, buffers, gradients and optimizer state (each storage once), as counted."""
        live = self._tensor_counter()
        return live.current if live is not None else 0

    def _record(self, step: int, live: LiveBytes | None) -> None:
        r = self.read(step, live)
        self.readings.append(r)
        self.tracker.log_metrics(r.metrics(), step=step)
        share = f" ({r.fraction:.0%} of {self.budget.bytes / GB:.4g} GB {self.budget.source})" if r.fraction else ""
        self.postfix = {"mem": f"{r.peak_bytes / GB:.3g}GB" + (f"/{r.fraction:.0%}" if r.fraction else "")}
        log.info("memory at step %d: peak %.4g GB%s [%s]; allocated %.4g GB, reserved %.4g GB, RSS %.4g GB",
                 step, r.peak_bytes / GB, share, r.measure, r.allocated_bytes / GB, r.reserved_bytes / GB,
                 r.rss_bytes / GB)
        if not self.warned and self._over(r.peak_bytes):
            self._warn(r)
        stop_at = self.cfg.stop_at_fraction
        if stop_at is not None and not self.stop_requested and self._over(r.peak_bytes, stop_at):
            self._stop(r)

    def _event(self, name: str, r: MemoryReading, threshold: float) -> dict[str, Any]:
        return {"event": name, "run_name": self.run_name, "mlflow_run_id": self.tracker.run_id,
                "device": str(self.device), "budget_source": self.budget.source, "threshold_fraction": threshold,
                "fraction": round(r.fraction or 0.0, 6), **{k: v for k, v in asdict(r).items()}}

    def _emit(self, event: dict[str, Any]) -> None:
        for sink in _SINKS:
            try:
                sink(event)
            except Exception:
                log.exception("memory event sink %r failed", sink)

    def _warn(self, r: MemoryReading) -> None:
        self.warned = True
        msg = (f"memory peak {r.peak_bytes / GB:.4g} GB [{r.measure}] at step {r.step} is {r.fraction:.0%} of the "
               f"{self.budget.bytes / GB:.4g} GB budget ({self.budget.source}), above monitor.warn_fraction="
               f"{self.cfg.warn_fraction}; allocated {r.allocated_bytes / GB:.4g} GB, reserved "
               f"{r.reserved_bytes / GB:.4g} GB")
        event = self._event(WARNING_EVENT, r, self.cfg.warn_fraction)
        log.warning("%s", msg, extra={"memfit_event": event})
        self.tracker.set_tags({"memfit.memory.warning": msg, "memfit.memory.warning_step": str(r.step)})
        self._emit(event)

    def _stop(self, r: MemoryReading) -> None:
        self.stop_requested, self.stop_reading = True, r
        self.stop_message = (
            f"memory peak {r.peak_bytes / GB:.4g} GB [{r.measure}] at step {r.step} passed monitor.stop_at_fraction="
            f"{self.cfg.stop_at_fraction} of the {self.budget.bytes / GB:.4g} GB budget ({self.budget.source}): "
            f"stopped with a training checkpoint instead of running out of memory; {self.advice}")
        event = self._event(LIMIT_EVENT, r, self.cfg.stop_at_fraction)
        log.error("%s", self.stop_message, extra={"memfit_event": event})
        self.tracker.set_tags({"memfit.memory.limit": self.stop_message, "memfit.status": "memory_limit"})
        self._emit(event)
