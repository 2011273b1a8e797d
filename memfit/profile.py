"""`memfit profile`: a few real training steps per policy, then one step's memory timeline, tables and charts."""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from memfit import profile_trace
from memfit.config import MemfitConfig
from memfit.errors import ConfigError, TrackingError

log = logging.getLogger("memfit.profile")

_NO_TIMELINE = ("timeline", "spans", "largest_allocations")


def default_out_dir(cfg: MemfitConfig) -> Path:
    return Path(cfg.run.work_dir).parent / "profile"


PLANNED = "auto"  # in --compare: the stack the planner picks, as `memfit run` would train it


def planned_stack(cfg: MemfitConfig) -> Any:
    """The PlanReport `memfit run` would train with: the probe, then the planner (or the fixed memory.policy)."""
    from memfit import phases

    return phases.plan_stack(cfg, phases.check_environment_and_probe(cfg))


def fixed_stack(cfg: MemfitConfig, name: str) -> Any:
    """A plan for one named policy at the config's own precision, micro-batch and LoRA setting."""
    from memfit.run_context import configured_plan

    try:
        return configured_plan(cfg, name, reason="memfit profile --compare")
    except ConfigError as err:
        raise ConfigError(f"--compare {name}: {err}".replace("choose one of auto, ", "choose from auto, ")) from None


def profile(cfg: MemfitConfig, out_dir: str | Path | None = None, steps: int = 3, compare: list[str] | None = None,
            trace: bool = False, mlflow_run: str | None = None) -> dict[str, Any]:
    """Profile each policy (the planned stack when `compare` is empty) and write profile.json, modules.md, PNGs.

    Every stack trains `steps` real optimizer steps (micro-batch, accumulation, precision and LoRA as planned,
    through the same model building and Trainer as `memfit run`) from the same weights; the last step is
    recorded. On CUDA (or with `trace`) one more step runs under torch.profiler, and on CUDA under the
    allocator's history. `auto` in `compare` stands for the planner's choice.
    """
    from memfit import run_context
    from memfit.data.cache import cached_data
    from memfit.runtime.env import pin_threads, resolve_device

    if steps < 2:
        raise ConfigError(f"--steps {steps}: need at least 2 (one to create the optimizer state, one to record)")
    out = Path(out_dir) if out_dir is not None else default_out_dir(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create the folder ({err.strerror or err})") from None
    names = list(dict.fromkeys(compare or [PLANNED]))
    # Unknown names fail before any model is built; the planner runs once, first.
    plans = {n: fixed_stack(cfg, n) for n in names if n != PLANNED}
    if PLANNED in names:
        plans[PLANNED] = planned_stack(cfg)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = run_context.load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)
    cuda = device.type == "cuda"
    workload = {"model_source": cfg.model.name_or_path or f"preset:{cfg.model.preset}",
                "n_params": sum(p.numel() for p in inputs.model.parameters()), "device": str(device),
                "micro_batch_size": cfg.train.micro_batch_size, "grad_accum_steps": cfg.train.grad_accum_steps,
                "seq_len": cfg.data.seq_len, "precision": cfg.train.precision, "steps": steps,
                "measure": "live tensor storages (dispatcher-level, as torch's MemTracker)"
                           + (", 512-byte CUDA blocks" if cuda else "")}
    summaries: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}
    for name in names:
        plan = plans[name]
        log.info("profiling %s (%s): %d steps on %s", name, plan.description, steps, device)
        summaries[name], extra = _profile_stack(cfg, inputs.model, data, device, name, plan, steps, out,
                                                trace=trace or cuda, cuda_history=cuda)
        files.update(extra)
    subtitle = (f"{workload['model_source']} ({workload['n_params'] / 1e6:.3g} M parameters), micro-batch "
                f"{workload['micro_batch_size']} x {workload['seq_len']} tokens x {workload['grad_accum_steps']} "
                f"accumulation, {workload['precision']}, {device}")
    files.update(_write_outputs(out, workload, summaries, subtitle))
    result = {"out_dir": str(out.absolute()), "workload": workload, "files": files,
              "policies": {n: {k: v for k, v in s.items() if k not in _NO_TIMELINE} for n, s in summaries.items()}}
    if mlflow_run:
        result["mlflow_run_id"] = _log_to_mlflow(cfg, mlflow_run, out, summaries)
    return result


def _profile_stack(cfg: MemfitConfig, base_model: torch.nn.Module, data: Any, device: torch.device, name: str,
                   plan: Any, steps: int, out: Path, trace: bool, cuda_history: bool
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    from memfit import run_context
    from memfit.memory.estimator.breakdown import summarize
    from memfit.memory.estimator.timeline import StepTimeline
    from memfit.tracking.null import NullTracker
    from memfit.training.loop import Trainer

    model = run_context.build_training_model(cfg, copy.deepcopy(base_model), plan)
    trainer = Trainer(cfg=cfg, plan=plan, model=model, data=data, device=device,
                      tracker=NullTracker(), checkpoints=None, identity={})
    model.train()
    seconds, tokens = [], []
    for _ in range(steps - 1):
        seconds.append(_timed_step(trainer, device))
        tokens.append(trainer.step_counts[2])  # computed tokens: a DPO step's rows are cut to the longest pair
    tl = StepTimeline(model, device)
    tl.adopt([p for p in model.parameters()], "parameter")
    tl.adopt(list(model.buffers()), "buffer")
    tl.adopt([p.grad for p in model.parameters() if p.grad is not None], "gradient")
    tl.adopt([v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
             "optimizer")
    with tl:
        trainer.optimizer_step()
    tl.classify()
    summary = summarize(tl, model, trainer.optimizer)
    # The first step builds the optimizer state and warms caches: time the later ones.
    summary.update(policy=plan.policy, description=plan.description, block_kinds=plan.block_kinds,
                   lora=plan.lora, precision=plan.precision, micro_batch_size=plan.micro_batch_size,
                   grad_accum_steps=plan.grad_accum_steps, predicted_peak_bytes=plan.predicted_peak_bytes,
                   step_seconds=statistics.median(seconds[1:] or seconds), step_times=seconds,
                   tokens_per_step=statistics.median(tokens[1:] or tokens), objective=cfg.train.objective,
                   reference=getattr(getattr(trainer.loss, "reference", None), "name", None),
                   tokens_per_second=sum(tokens[1:] or tokens) / sum(seconds[1:] or seconds))
    files: dict[str, str] = {}
    if cuda_history:
        files.update(_cuda_memory_history(trainer, out, name))
    if trace:
        files.update(_profiler_trace(trainer, device, out, name))
        summary["where"] = profile_trace.read(files[f"trace_{name}"])
    del trainer, model, tl
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summary, files


def _timed_step(trainer: Any, device: torch.device) -> float:
    t0 = time.perf_counter()
    trainer.optimizer_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _cuda_memory_history(trainer: Any, out: Path, name: str) -> dict[str, str]:
    """One step under the CUDA allocator's history: the snapshot (for pytorch.org/memory_viz) and its HTML."""
    from torch.cuda._memory_viz import trace_plot

    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        trainer.optimizer_step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    pkl = out / f"memory_snapshot_{name}.pickle"
    # Written, never read back by memfit: the format torch's own _dump_snapshot writes for the visualiser.
    _write_bytes(pkl, pickle.dumps(snapshot))
    html = out / f"memory_{name}.html"
    _write_bytes(html, trace_plot(snapshot).encode())
    return {f"cuda_snapshot_{name}": str(pkl), f"cuda_memory_html_{name}": str(html)}


def _profiler_trace(trainer: Any, device: torch.device, out: Path, name: str) -> dict[str, str]:
    """One step under torch.profiler with memory profiling, as a Chrome trace (chrome://tracing, Perfetto)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        trainer.optimizer_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    path = out / f"trace_{name}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(path)
    return {f"trace_{name}": str(path)}


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _write_outputs(out: Path, workload: dict[str, Any], summaries: dict[str, dict[str, Any]],
                   subtitle: str) -> dict[str, str]:
    from memfit.memory.estimator.charts import plot_compare, plot_timeline

    files: dict[str, str] = {}
    for name, s in summaries.items():
        files[f"timeline_{name}"] = str(plot_timeline(name, s, out / f"timeline_{name}.png", subtitle))
    if len(summaries) > 1:
        files["compare"] = str(plot_compare(summaries, out / "compare.png", subtitle))
    md = ["# memfit memory profile", "", (
        f"Workload: {subtitle}. Figures in MB (1e6 bytes) of live tensor storages over one optimizer step. "
        "`activations`: alive when the first forward returns (saved for backward); `recomputed`: rebuilt in "
        "the first backward; `temporaries (peak)`: the most short-lived bytes a module held at once; "
        "`fwd/bwd peak`: the step's total while that module ran."), ""]
    md += [_section(name, s) for name, s in summaries.items()]
    _write_bytes(out / "modules.md", "\n".join(md).encode())
    files["markdown"] = str(out / "modules.md")
    doc = {"workload": workload, "compare": list(summaries), "policies": summaries, "files": dict(files)}
    doc["files"]["json"] = str(out / "profile.json")
    _write_bytes(out / "profile.json", json.dumps(doc, indent=1).encode())
    files["json"] = str(out / "profile.json")
    return files


def _section(name: str, s: dict[str, Any]) -> str:
    from memfit.memory.estimator.breakdown import markdown

    dpo = f"dpo (reference {s['reference']}); " if s.get("objective") == "dpo" else ""
    text = markdown(name, f"{dpo}{s['description']}; {s['step_seconds']:.3f} s per step (median, untracked), "
                          f"{s['tokens_per_second']:,.0f} tokens/s computed.", s)
    if "where" not in s:
        return text
    return "\n".join([text.rstrip("\n"), "", f"### Where the time of one traced step goes (`trace_{name}.json`)", "",
                      *profile_trace.markdown(s["where"]), ""])


def _log_to_mlflow(cfg: MemfitConfig, run: str, out: Path, summaries: dict[str, dict[str, Any]]) -> str:
    """Log the profile folder and headline figures to MLflow: into run `run`, or a new run for `new`."""
    from memfit.tracking import make_tracker

    if cfg.tracking.backend == "null":
        raise ConfigError("--mlflow-run: tracking.backend is null; set tracking.backend=mlflow (and tracking.uri)")
    tracker = make_tracker(cfg.tracking)
    new = run == "new"
    if new:
        tracker.start_run(f"{cfg.run.name}-profile", tags={"memfit.kind": "profile"})
    else:
        try:
            tracker.client.get_run(run)  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - mlflow raises MlflowException subclasses
            raise TrackingError(f"--mlflow-run {run}: no such run in {cfg.tracking.resolved_uri()} ({err}); "
                                "pass a run id from that store, or 'new'") from None
        tracker.run_id = run  # attach without reopening it: a finished run stays finished
    metrics: dict[str, float] = {}
    for name, s in summaries.items():
        metrics.update({f"profile.{name}.peak_bytes": s["peak_bytes"],
                        f"profile.{name}.peak_activation_bytes": s["peak_activation_bytes"],
                        f"profile.{name}.step_seconds": s["step_seconds"],
                        f"profile.{name}.tokens_per_second": s["tokens_per_second"]})
    tracker.log_metrics(metrics, step=0)
    tracker.set_tags({"memfit.profile.policies": ",".join(summaries)})
    tracker.log_artifact(out, "profile")
    if new:
        tracker.end_run("FINISHED")
    else:
        tracker.flush()
    return str(tracker.run_id)
