"""The five phases as plain functions over the config; Prefect tasks wrap them one to one."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.checkpointing import CheckpointManager, read_checkpoint_folder
from memfit.config import MemfitConfig
from memfit.data import DataBundle, load_texts, data_digest
from memfit.datacache import cached_data
from memfit.env import environment_report, pin_threads, resolve_device
from memfit.errors import CheckpointError, ConfigError, MemoryLimitError, Preempted
from memfit.memory.plan import make_plan
from memfit.memory.policies import apply_policy, make_policy
from memfit.memory.probe import budget_bytes, measure_step, verdict
from memfit.modeling import check_seq_len, load_model, load_model_and_tokenizer
from memfit.preemption import stop_on_signals
from memfit.reports import ExportReport, PlanReport, ProbeReport, ResumePoint, TrainReport
from memfit.storage import open_store
from memfit.tracking import make_tracker

log = logging.getLogger("memfit.pipeline")


# -- shared set-up ------------------------------------------------------------------------------------
@dataclass
class Inputs:
    texts: list[str]
    digest: str
    model: Any
    tokenizer: Any
    source: str


def load_inputs(cfg: MemfitConfig) -> Inputs:
    """Texts, the model (a preset is built on first use) and its tokenizer, all through from_pretrained."""
    texts = load_texts(cfg.data)
    digest = data_digest(texts)
    model, tokenizer, source = load_model_and_tokenizer(cfg, texts, digest)
    check_seq_len(cfg, model.config)
    return Inputs(texts=texts, digest=digest, model=model, tokenizer=tokenizer, source=source)


def run_identity(cfg: MemfitConfig) -> dict[str, Any]:
    """The settings a resumed run must share with its training checkpoints (max_steps may grow)."""
    t = cfg.train.model_dump(mode="json")
    for volatile in ("max_steps", "device", "num_threads", "log_every_steps", "eval_batches"):
        t.pop(volatile)
    return {"model": cfg.model.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"), "train": t}


def _staging(cfg: MemfitConfig, what: str) -> Path:
    key = hashlib.sha256(cfg.checkpoint.uri.encode()).hexdigest()[:12]
    return Path(cfg.run.work_dir) / what / key


def checkpoint_manager(cfg: MemfitConfig) -> CheckpointManager:
    return CheckpointManager(open_store(cfg.checkpoint.uri), keep_last=cfg.checkpoint.keep_last,
                             staging_dir=_staging(cfg, "staging"))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _check_writable_dir(path: str, field: str) -> None:
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_file = folder / f".memfit-write-test-{os.getpid()}"
        probe_file.write_bytes(b"ok")
        probe_file.unlink()
    except OSError as err:
        raise ConfigError(f"{field}: cannot write to {folder} ({err.strerror or err}); choose a writable folder "
                          f"with --set {field}=PATH") from None


def preflight(cfg: MemfitConfig) -> None:
    """Fail in seconds, before any model is built, on outputs that could not be written later."""
    _check_writable_dir(cfg.run.work_dir, "run.work_dir")
    _check_writable_dir(cfg.export.dir, "export.dir")
    if "://" not in cfg.checkpoint.uri or cfg.checkpoint.uri.startswith("file://"):
        open_store(cfg.checkpoint.uri).check_writable()


# -- phase 1 ------------------------------------------------------------------------------------------
def probe(cfg: MemfitConfig) -> ProbeReport:
    """Environment report, then one real training step with no gradient checkpointing, against the budget."""
    preflight(cfg)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    model = inputs.model.to(device)
    env = environment_report(device, cfg.checkpoint.uri if "://" not in cfg.checkpoint.uri else ".")
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    with torch.random.fork_rng(devices=[]):  # the probe's batch must not shift the run's RNG stream
        torch.manual_seed(cfg.train.seed)
        batch = torch.randint(0, model.config.vocab_size, (micro, seq), device=device)
    make_policy("none").apply(model)
    step = measure_step(model, batch, cfg.train.precision)
    budget, source = budget_bytes(cfg.memory.budget_gb, env["device"])
    baseline = verdict(step, budget, source, micro, seq)
    log.info("baseline probe: %s", baseline.message)
    n_params = sum(p.numel() for p in model.parameters())
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ProbeReport(environment=env, baseline=baseline.to_dict(), model_source=_source_name(cfg),
                       n_params=n_params)


def _source_name(cfg: MemfitConfig) -> str:
    return cfg.model.name_or_path or f"preset:{cfg.model.preset}"


# -- phase 2 ------------------------------------------------------------------------------------------
def setup_stack(cfg: MemfitConfig, probe_report: ProbeReport) -> PlanReport:
    """Choose the gradient-checkpointing policy and precision; check they can apply here."""
    b = probe_report.baseline
    plan = make_plan(cfg.memory, cfg.train, b.get("peak_bytes"), b.get("budget_bytes"), bool(b.get("oom")))
    policy = make_policy(plan.policy, every_k=plan.every_k, save_ops=cfg.memory.selective_save_ops)
    device = probe_report.environment["device"]
    if plan.policy == "offload" and device["type"] != "cuda":
        policy.apply(torch.nn.Linear(1, 1))  # raises the policy's own clear error
    if plan.precision in ("bf16-mixed", "bf16-true") and device["type"] == "cuda" and not device["bf16_supported"]:
        raise ConfigError(f"train.precision={plan.precision}: {device['name']} has no bf16; use fp16-mixed")
    log.info("optimisation stack: %s (%s)", policy.describe(), plan.reason)
    return PlanReport(**plan.to_dict(), description=policy.describe())


def build_training_model(cfg: MemfitConfig, model: torch.nn.Module, plan: PlanReport) -> torch.nn.Module:
    """Apply the planned gradient-checkpointing policy (its one entry point) with use_cache off."""
    apply_policy(model, make_policy(plan.policy, every_k=plan.every_k, save_ops=cfg.memory.selective_save_ops))
    model.config.use_cache = False
    return model


# -- phase 4 ------------------------------------------------------------------------------------------
def recover(cfg: MemfitConfig) -> ResumePoint:
    """Find the newest training checkpoint of this run that verifies, download it, check it is this run's."""
    store = open_store(cfg.checkpoint.uri)
    store.check_writable()  # a missing bucket or bad credentials fail here, before any training
    manager = CheckpointManager(store, keep_last=cfg.checkpoint.keep_last)
    point = ResumePoint(checkpoint_uri=cfg.checkpoint.uri)
    complete = manager.list()
    if not complete:
        return point
    if not cfg.checkpoint.resume:
        raise CheckpointError(f"checkpoint.uri {cfg.checkpoint.uri} already holds training checkpoints (newest "
                              f"step {complete[-1].step}) and checkpoint.resume is false; point checkpoint.uri "
                              "at an empty location or remove them (memfit checkpoints ls shows them)")
    dest = _staging(cfg, "resume")
    shutil.rmtree(dest, ignore_errors=True)
    loaded = manager.latest(dest)
    if loaded is None:
        log.warning("no training checkpoint under %s verifies; starting from scratch", cfg.checkpoint.uri)
        return point
    theirs, ours = loaded.state.get("identity", {}), run_identity(cfg)
    if theirs != ours:
        diff = sorted(f"{sec}.{k}" for sec in ours for k in set(ours[sec]) | set(theirs.get(sec, {}))
                      if ours[sec].get(k) != theirs.get(sec, {}).get(k))
        raise CheckpointError(f"checkpoint.uri {cfg.checkpoint.uri} holds training checkpoints of a different run "
                              f"(differs in {', '.join(diff) or 'format'}); use another checkpoint.uri for a new "
                              "run, or restore those settings to resume it")
    log.info("resuming from training checkpoint %s (step %d)", loaded.info.uri, loaded.step)
    return point.model_copy(update={
        "step": loaded.step, "source_uri": loaded.info.uri, "local_dir": str(dest / loaded.info.prefix),
        "mlflow_run_id": loaded.state.get("mlflow_run_id"), "finished": loaded.step >= cfg.train.max_steps})


# -- phase 3 ------------------------------------------------------------------------------------------
def train(cfg: MemfitConfig, plan: PlanReport, resume: ResumePoint, probe_report: ProbeReport | None = None
          ) -> TrainReport:
    """Train to train.max_steps from the resume point, logging to the tracker and saving training checkpoints."""
    from memfit.train import Trainer

    if resume.finished:
        log.info("run already finished at step %s (%s): not retraining", resume.step, resume.source_uri)
        return finished_train_report(cfg, resume)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer)
    model = build_training_model(cfg, inputs.model, plan)
    tracker = make_tracker(cfg.tracking)
    run_id = tracker.start_run(cfg.run.name, run_id=resume.mlflow_run_id, tags=_tags(device))
    manager = checkpoint_manager(cfg)
    try:
        trainer = Trainer(cfg, model, data, device, tracker, manager, run_identity(cfg))
        if resume.local_dir:
            trainer.restore(read_checkpoint_folder(Path(resume.local_dir)))
            tracker.set_tags({"memfit.resumed_from_step": str(resume.step)})
        else:
            _log_run_start(tracker, cfg, plan, data, probe_report)
        with stop_on_signals() as stop:
            result = trainer.fit(stop)
    except BaseException:
        tracker.end_run("FAILED")
        raise
    finally:
        manager.close()
    if trainer.monitor.stop_requested and result.steps < cfg.train.max_steps:
        tracker.end_run("KILLED")
        raise MemoryLimitError(f"{trainer.monitor.stop_message} (training checkpoint {result.last_checkpoint_uri})")
    if result.preempted:
        tracker.set_tags({"memfit.status": "preempted"})
        tracker.end_run("KILLED")
        raise Preempted(f"preempted at step {result.steps}: training checkpoint {result.last_checkpoint_uri} "
                        "committed; run the same command again to resume")
    return TrainReport(mlflow_run_id=run_id, **result.__dict__)


def _tags(device: torch.device) -> dict[str, str]:
    tags = {"memfit.version": memfit.__version__, "memfit.device": device.type, "memfit.host": platform.node()}
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def _log_run_start(tracker: Any, cfg: MemfitConfig, plan: PlanReport, data: DataBundle,
                   probe_report: ProbeReport | None) -> None:
    params = cfg.flat()
    params.update({f"plan.{k}": v for k, v in plan.model_dump().items()})
    params.update({"data.digest": data.digest, "data.train_blocks": len(data.train),
                   "data.val_blocks": len(data.val), "data.source": data.source})
    tracker.log_params(params)
    tracker.log_text(cfg.to_yaml(), "config/resolved.yaml")
    tracker.log_text(json.dumps(plan.model_dump(), indent=2), "memory/plan.json")
    if probe_report is not None:
        tracker.log_text(json.dumps(probe_report.environment, indent=2), "environment/report.json")
        tracker.log_text(json.dumps(probe_report.baseline, indent=2), "memory/baseline_probe.json")
        tracker.log_metrics({"baseline_peak_bytes": probe_report.baseline["peak_bytes"]}, step=0)


# -- phase 5 ------------------------------------------------------------------------------------------
def evaluate_and_export(cfg: MemfitConfig, train_report: TrainReport) -> ExportReport:
    """Load the final training checkpoint, measure validation loss, export SafeTensors + ONNX and verify both."""
    from memfit.export import export_onnx, export_safetensors
    from memfit.train import evaluate_loss

    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer)
    manager = checkpoint_manager(cfg)
    dest = _staging(cfg, "export-src")
    shutil.rmtree(dest, ignore_errors=True)
    final = manager.latest(dest)
    if final is None:
        raise CheckpointError(f"no complete training checkpoint under {cfg.checkpoint.uri} to export")
    model = inputs.model
    model.load_state_dict(final.model_state, strict=True)
    model.to(device=device, dtype=torch.float32)  # exports and evaluation are fp32
    val_loss = evaluate_loss(model, data.val, cfg.train.micro_batch_size, device, "fp32", cfg.train.eval_batches)
    ppl = math.exp(min(val_loss, 50.0))
    tracker = make_tracker(cfg.tracking)
    tracker.start_run(cfg.run.name, run_id=train_report.mlflow_run_id)
    try:
        tracker.log_metrics({"val_loss": val_loss, "val_perplexity": ppl}, step=train_report.steps)
        out = Path(cfg.export.dir)
        meta = {"source_checkpoint": final.info.uri, "mlflow_run_id": train_report.mlflow_run_id,
                "step": final.step, "model_source": _source_name(cfg)}
        st = export_safetensors(model, inputs.tokenizer, out / "hf", metadata=meta)
        onnx_res = None
        if cfg.export.onnx:
            onnx_res = export_onnx(model.cpu(), out / "model.onnx", atol=cfg.export.onnx_atol, opset=cfg.export.opset)
            tracker.log_metrics({"onnx_max_abs_diff": onnx_res.max_abs_diff}, step=train_report.steps)
        tracker.log_artifact(st.dir, "export/hf")
        if onnx_res is not None:
            tracker.log_artifact(onnx_res.path, "export/onnx")
        tracker.end_run("FINISHED")
    except BaseException:
        tracker.end_run("FAILED")
        raise
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    return ExportReport(final_val_loss=val_loss, final_val_perplexity=ppl, safetensors_dir=st.dir,
                        safetensors_max_abs_diff=st.max_abs_diff,
                        onnx_path=onnx_res.path if onnx_res else None,
                        onnx_max_abs_diff=onnx_res.max_abs_diff if onnx_res else None,
                        onnx_opset=onnx_res.opset if onnx_res else None, source_checkpoint=final.info.uri)


def finished_train_report(cfg: MemfitConfig, resume: ResumePoint) -> TrainReport:
    """A finished run is not retrained: its report comes from the final training checkpoint."""
    state = json.loads((Path(resume.local_dir) / "state.json").read_text()) if resume.local_dir else {}
    return TrainReport(mlflow_run_id=resume.mlflow_run_id or "", start_step=resume.step or 0,
                       steps=resume.step or 0, resumed_from=resume.step, preempted=False,
                       initial_val_loss=state.get("initial_val_loss"), final_train_loss=None, tokens_per_s=None,
                       peak_memory_bytes=0, last_checkpoint_uri=resume.source_uri)


def absolute_uri(uri: str) -> str:
    """Local paths made absolute (so a summary is usable from any folder); remote URIs unchanged."""
    if "://" in uri:
        return uri
    return str(Path(uri).absolute())


def set_telemetry_off() -> None:
    for k, v in {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
        os.environ.setdefault(k, v)
