"""What every phase and rank shares: inputs, run identity, stores, the training model, MLflow set-up, plan tables."""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.checkpoints import CheckpointManager
from memfit.config import MemfitConfig
from memfit.data.prepare import DataBundle
from memfit.memory.planner import limits
from memfit.memory.planner.plan import MeasuredPeak
from memfit.memory.techniques.policies import apply_policy, configured_policy
from memfit.models.loading import check_seq_len, load_model_and_tokenizer
from memfit.reports import PlanReport, ProbeReport
from memfit.runtime.recovery import run_key
from memfit.storage import open_checkpoint_store
from memfit.tracking.records import log_memory_figure, on_tracker

log = logging.getLogger("memfit.run_context")


@dataclass
class Inputs:
    texts: Any  # a DataSource: records read only when a preset is built or the packed rows are not cached
    digest: str | None
    model: Any
    tokenizer: Any
    source: str


def load_inputs(cfg: MemfitConfig) -> Inputs:
    """The data source, the model (a preset is built on first use) and its tokenizer, all through
    from_pretrained. The records are not read here for a named model: the packed rows may be cached."""
    from memfit.data.source import DataSource

    data = DataSource(cfg.data, cfg.run.work_dir)
    digest = None if cfg.model.name_or_path else data.digest()
    model, tokenizer, source = load_model_and_tokenizer(cfg, data.texts if digest else [], digest or "")
    check_seq_len(cfg, model.config)
    return Inputs(texts=data, digest=digest, model=model, tokenizer=tokenizer, source=source)


def run_identity(cfg: MemfitConfig) -> dict[str, Any]:
    """The settings a resumed run must share with its training checkpoints (max_steps may grow)."""
    t = cfg.train.model_dump(mode="json")
    for volatile in ("max_steps", "device", "num_threads", "log_every_steps", "eval_batches", "compile"):
        t.pop(volatile)
    out = {"model": cfg.model.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"), "train": t}
    if t["objective"] == "sft":  # as before objectives existed, so earlier SFT checkpoints still resume
        del t["objective"]
        for key in ("chosen_field", "rejected_field"):
            del out["data"][key]
    else:
        out["dpo"] = cfg.dpo.model_dump(mode="json")
    out["data"].pop("num_proc", None)  # how fast the rows are prepared, not which
    if not out["data"]["streaming"]:  # as before streaming existed, so earlier checkpoints still resume
        for key in ("streaming", "shuffle_buffer"):
            del out["data"][key]
    return out


def identity_key(cfg: MemfitConfig) -> str:
    """A short hash of run_identity: a measured memory limit applies to the same workload only."""
    return hashlib.sha256(json.dumps(run_identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def memory_limits_path(cfg: MemfitConfig) -> Path:
    """This logical run's copy of its memory limits in the local plan cache (the store keeps the other)."""
    uri = cfg.checkpoint.uri if "://" in cfg.checkpoint.uri else str(Path(cfg.checkpoint.uri).absolute())
    return limits.local_path(cfg.run.work_dir, run_key(cfg.run.name, uri))


def measured_peaks_for(cfg: MemfitConfig) -> list[MeasuredPeak]:
    """With recovery.on_memory_limit leaner: the stacks this run was stopped at the memory limit with, as the
    planner must respect them; with stop: none (the same stack is planned again, for a person to decide)."""
    if cfg.recovery.on_memory_limit != "leaner":
        return []
    records = limits.load(open_checkpoint_store(cfg), memory_limits_path(cfg))
    return limits.measured_peaks(records, identity_key(cfg), cfg.memory.budget_gb, cfg.monitor.stop_at_fraction)


def remember_memory_limit(cfg: MemfitConfig, plan: PlanReport, reading: dict[str, Any]) -> list[str]:
    """Record the peak that stopped training against the stack that ran, beside its training checkpoints and in
    the local plan cache; returns where it was written."""
    record = limits.record_from(plan, reading, identity_key(cfg), cfg.monitor.stop_at_fraction or 1.0, time.time())
    written = limits.save(open_checkpoint_store(cfg), memory_limits_path(cfg), record)
    log.info("memory limit recorded: %s measured %.4g GB at step %d (%s)", plan.description,
             record.measured_bytes / 1e9, record.step, ", ".join(written) or "nowhere")
    return written


def staging_dir(cfg: MemfitConfig, what: str) -> Path:
    """A local folder for `what` (staging, resume, export-src, ...) of this run's checkpoint.uri."""
    key = hashlib.sha256(cfg.checkpoint.uri.encode()).hexdigest()[:12]
    return Path(cfg.run.work_dir) / what / key


def checkpoint_manager(cfg: MemfitConfig) -> CheckpointManager:
    ck = cfg.checkpoint
    return CheckpointManager(open_checkpoint_store(cfg), keep_last=ck.keep_last,
                             staging_dir=staging_dir(cfg, "staging"), on_busy=ck.on_busy,
                             upload_attempts=ck.upload_attempts, retry_backoff_s=ck.retry_backoff_seconds,
                             grace_seconds=ck.grace_seconds, every_steps=ck.every_steps)


def sharded_checkpointer(cfg: MemfitConfig, rank: int, world_size: int) -> Any:
    """One rank's side of sharded training checkpoints, with the same writer settings as one process."""
    from memfit.checkpoints.sharded import ShardedCheckpointer

    ck = cfg.checkpoint
    return ShardedCheckpointer(open_checkpoint_store(cfg), staging_dir(cfg, "dcp-staging"), rank, world_size,
                               ck.keep_last, commit_timeout_s=cfg.distributed.timeout_minutes * 60,
                               every_steps=ck.every_steps, on_busy=ck.on_busy, upload_attempts=ck.upload_attempts,
                               retry_backoff_s=ck.retry_backoff_seconds, grace_seconds=ck.grace_seconds)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def configured_plan(cfg: MemfitConfig, policy: str = "none", reason: str = "as configured") -> PlanReport:
    """A plan the planner did not make: `policy` with the config's own precision, micro-batch, LoRA setting and
    techniques (`memfit profile --compare`, benchmarks, tests); an auto loss or optimizer is resolved when built."""
    m = cfg.memory
    description = configured_policy(m, policy).describe()
    lora = cfg.lora.enabled is True
    return PlanReport(policy=policy, every_k=m.every_k, precision=cfg.train.precision,
                      micro_batch_size=cfg.train.micro_batch_size, grad_accum_steps=cfg.train.grad_accum_steps,
                      reason=reason, description=description, lora=lora,
                      quantize=cfg.lora.quantize if lora else "none", loss=m.loss, optimizer=m.optimizer,
                      optimizer_in_backward=m.optimizer_in_backward is True, lean_layers=m.lean_layers is True)


def build_training_model(cfg: MemfitConfig, model: torch.nn.Module, plan: PlanReport) -> torch.nn.Module:
    """LoRA adapters (on a 16-bit or 4-bit frozen base) when planned, the lean SwiGLU/RMSNorm layers when
    planned or set, then the planned gradient-checkpointing policy (its one entry point), then train.compile."""
    if plan.lora:
        from memfit.models.lora import prepare_lora_model

        model = prepare_lora_model(model, cfg.lora, plan.precision, quantize=plan.quantize, seed=cfg.train.seed)
    if plan.lean_layers:
        from memfit.memory.techniques.lean_layers import apply_lean_layers

        log.info("memory.lean_layers: %s", apply_lean_layers(model))
    kinds = plan.block_kinds if plan.policy == "mixed" else None
    apply_policy(model, configured_policy(cfg.memory, plan.policy, plan.every_k, kinds))
    if cfg.train.compile:  # last: the compiled blocks run what LoRA, lean layers and the policy made of them
        from memfit.training.compile import compile_blocks

        log.info("train.compile: %d decoder blocks compiled in place", compile_blocks(model, cfg.memory.block_class))
    return model


def log_training_end(tracker: Any, plan: PlanReport, probe_report: ProbeReport | None, steps: int) -> None:
    """The memory figure and the tracking overhead; the run stays open for phase 5 (which ends it)."""
    tracker.flush()
    overhead = getattr(tracker, "overhead", lambda: None)()
    if overhead is not None:
        log.info("metric logging took %.3f%% of step time on the training thread (+%.3f%% in its writer thread)",
                 100 * overhead["tracking_overhead_fraction"], 100 * overhead["tracking_writer_fraction"])
        tracker.log_metrics(overhead, step=steps)
    # Made where the store is open (the tracking process in `memfit run`: no matplotlib here).
    on_tracker(tracker, log_memory_figure, probe_report.baseline if probe_report else None, plan.model_dump())
    close = getattr(tracker, "close", None)
    if close is not None:
        close()


def record_plan_at_resume(tracker: Any, plan: PlanReport, step: int | None) -> None:
    """On the run in MLflow: the plan reused from the training checkpoint, or why it was planned again and what
    changed (a tag and the new plan beside the first one)."""
    if plan.changes:
        tracker.set_tags({"memfit.plan": "replanned", "memfit.plan_changes": plan.changes[:4000]})
        tracker.log_text(json.dumps(plan.model_dump(mode="json"), indent=2), f"memory/plan-at-step-{step}.json")
    elif plan.reused_from_step is not None:
        tracker.set_tags({"memfit.plan": f"reused from the training checkpoint at step {plan.reused_from_step}"})


def run_tags(device: torch.device) -> dict[str, str]:
    tags = {"memfit.version": memfit.__version__, "memfit.device": device.type, "memfit.host": platform.node(),
            "memfit.device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else (platform.processor() or platform.machine()),
            "memfit.torch": torch.__version__}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def log_run_start(tracker: Any, cfg: MemfitConfig, plan: PlanReport, data: DataBundle,
                   probe_report: ProbeReport | None) -> None:
    params = cfg.flat()
    params.update({f"plan.{k}": v for k, v in plan.model_dump().items()
                   if k not in ("alternatives", "block_kinds", "table_markdown", "evaluation")})
    params.update({"data.digest": data.digest, "data.train_blocks": len(data.train),
                   "data.val_blocks": len(data.val), "data.source": data.source, "data.layout": data.packing,
                   **{f"data.{k}": v for k, v in data.stats.items() if k != "format"}})
    tracker.log_params(params)
    tracker.log_text(cfg.to_yaml(), "config/resolved.yaml")
    tracker.log_text(json.dumps(plan.model_dump(), indent=2), "memory/plan.json")
    tracker.log_text(plan_table(plan.model_dump(), probe_report.baseline if probe_report else None), "memory/plan.md")
    for context, blocks in (("training", data.train), ("validation", data.val)):
        tracker.log_dataset(f"{data.source} [{context}]", data.digest, cfg.data.path or data.source, context,
                            {"blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1]),
                             "tokens": int(blocks.numel())})
    tracker.log_metrics({"trained_tokens_share": data.trained_share()}, step=0)
    if plan.table_markdown:
        tracker.log_text(plan.table_markdown + "\n", "memory/plan_candidates.md")
    if probe_report is not None:
        tracker.log_text(json.dumps(probe_report.environment, indent=2), "environment/report.json")
        tracker.log_text(json.dumps(probe_report.baseline, indent=2), "memory/baseline_probe.json")
        tracker.log_metrics({"baseline_peak_bytes": probe_report.baseline["peak_bytes"]}, step=0)


def plan_table(plan: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    """The memory plan and the baseline probe as a Markdown table (memory/plan.md in the run)."""
    gb = 1e9
    lines = ["# Memory plan", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in plan.items() if k != "reason"]
    if plan.get("reason"):
        lines += ["", f"Why: {plan['reason']}"]
    if baseline:
        lines += ["", "## Baseline probe (one plain training step)", "", "| what | value |", "|---|---|"]
        for key in ("peak_bytes", "budget_bytes", "headroom_bytes"):
            if baseline.get(key) is not None:
                lines.append(f"| {key.removesuffix('_bytes')} | {baseline[key] / gb:.4f} GB |")
        lines += [f"| {k} | {baseline[k]} |" for k in ("fits", "oom", "budget_source", "method") if k in baseline]
        for kind, value in (baseline.get("breakdown") or {}).items():
            lines.append(f"| {kind} | {value / gb:.4f} GB |")
        if baseline.get("message"):
            lines += ["", str(baseline["message"])]
    return "\n".join(lines) + "\n"


def packing_alternatives(cfg: MemfitConfig, device: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """data.packing auto for `memfit plan`: the layout chosen and every candidate's prediction, for the target
    device (--device, else memory.device, else this machine). A hub model needs only its config and tokenizer."""
    from memfit.data.cache import resolve_auto_packing
    from memfit.memory.estimator.fake_model import model_config_for
    from memfit.models.loading import configured_tokenizer

    if cfg.train.objective == "dpo":  # preference pairs: one padded pair a row, nothing to weigh
        return "none", []
    if device:
        cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"device": device})})
    from memfit.data.source import DataSource

    texts = DataSource(cfg.data, cfg.run.work_dir)
    digest = texts.digest()
    if cfg.model.name_or_path:
        tokenizer = configured_tokenizer(cfg, cfg.model.name_or_path)
        hf_config = model_config_for(cfg)
    else:  # a preset: built on first use (small), as a run would
        model, tokenizer, _ = load_model_and_tokenizer(cfg, texts.texts, digest)
        hf_config = model.config
    return resolve_auto_packing(cfg, texts, digest, tokenizer, hf_config)


def prepare_for_ranks(cfg: MemfitConfig) -> None:
    """What every rank of a node would otherwise make at once, made here before torchrun starts: a preset's files,
    and the packed rows (from the tokenizer and the model's config; its weights are never loaded here), so the
    ranks find them cached instead of each preparing the same rows with data.num_proc workers of its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.data.cache import cached_data
    from memfit.data.source import DataSource
    from memfit.memory.estimator.fake_model import model_config_for
    from memfit.models.loading import configured_tokenizer, model_source

    if cfg.model.name_or_path and cfg.data.streaming:  # nothing to build, nothing to prepare: the ranks stream
        return
    texts = DataSource(cfg.data, cfg.run.work_dir)
    digest = texts.digest()
    source = model_source(cfg, texts.texts, digest)
    if cfg.data.streaming:
        return
    tokenizer = configured_tokenizer(cfg, source)
    hf_config = model_config_for(cfg) if cfg.model.name_or_path else AutoConfig.from_pretrained(source)
    try:  # the attention implementation a rank's model gets (packing auto weighs it)
        with torch.device("meta"):
            hf_config = AutoModelForCausalLM.from_config(hf_config,
                                                         trust_remote_code=cfg.model.trust_remote_code).config
    except Exception as err:  # noqa: BLE001 - a hint only: a rank whose layout key differs decides again
        log.info("data: the model was not built on the meta device (%s); packing auto assumes sdpa attention "
                 "here", str(err).splitlines()[0] if str(err) else type(err).__name__)
    cached_data(cfg, texts, digest, tokenizer, hf_config)
