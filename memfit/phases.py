"""The five phases of a run, in the order they run, as plain functions over the config (tasks/ wraps each)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoints import CheckpointIndex
from memfit.config import MemfitConfig
from memfit.data.cache import cached_data
from memfit.errors import CheckpointError, ConfigError, MemfitError, MemoryLimitError, Preempted
from memfit.memory.estimator.fake_model import config_from_dict
from memfit.memory.estimator.preference import ROWS_PER_PAIR
from memfit.memory.estimator.probe import explain_oom, measure_step, verdict, weights_to_device
from memfit.memory.planner.pair_length import planned_seq_len
from memfit.memory.planner.plan_cache import cache_path, load_plan, plan_key, store_plan
from memfit.memory.planner.replan import plan_at_resume, trained_as
from memfit.memory.planner.run_plan import run_plan
from memfit.memory.planner.search import estimate_policy, resolve_budget, target_profile
from memfit.memory.techniques.policies import make_policy
from memfit.preflight import preflight
from memfit.reports import AttemptReport, ExportReport, PlanReport, ProbeReport, ResumePoint, TrainReport
from memfit.run_context import (
    build_training_model,
    checkpoint_manager,
    load_inputs,
    log_run_start,
    log_training_end,
    measured_peaks_for,
    prepare_for_ranks,
    record_plan_at_resume,
    remember_memory_limit,
    run_identity,
    run_tags,
    staging_dir,
)
from memfit.runtime.env import environment_report, pin_threads, resolve_device
from memfit.runtime.preemption import stop_on_signals
from memfit.runtime.recovery import recovery_record
from memfit.runtime.spot import spot_watcher
from memfit.storage import open_checkpoint_store
from memfit.tracking import make_tracker
from memfit.tracking.base import scrub_obj

log = logging.getLogger("memfit.phases")


# -- phase 1 ------------------------------------------------------------------------------------------
def check_environment_and_probe(cfg: MemfitConfig) -> ProbeReport:
    """Environment report, then one real training step with no gradient checkpointing, against the budget."""
    preflight(cfg)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    # The report first: the device's free memory before this process puts weights there (the budget and the
    # measured peak both include them).
    env = environment_report(device, cfg.checkpoint.uri if "://" not in cfg.checkpoint.uri else ".")
    model = inputs.model
    if cfg.train.precision == "bf16-true":
        model.to(torch.bfloat16)  # the trainer holds pure bf16 weights: probe the step it will run
    # One rank's share of the micro-batch: that is what each process holds (all of it with one process).
    micro, seq = cfg.train.micro_batch_size // cfg.distributed.world_size, cfg.data.seq_len
    if cfg.train.objective == "dpo":  # a DPO micro-batch is each pair's chosen and rejected rows, cut to the longest
        micro, seq = micro * ROWS_PER_PAIR, planned_seq_len(cfg)
    model_config = model.config.to_dict()
    step = weights_to_device(model, device)
    if step is None:
        with torch.random.fork_rng(devices=[]):  # the probe's batch must not shift the run's RNG stream
            torch.manual_seed(cfg.train.seed)
            # Two micro-batches when accumulating: the second runs with the first one's gradients alive.
            batches = [torch.randint(0, model.config.vocab_size, (micro, seq)).to(device)
                       for _ in range(min(cfg.train.grad_accum_steps, 2))]
        make_policy("none", block_class=cfg.memory.block_class).apply(model)
        step = measure_step(model, batches, cfg.train.precision, cfg.train.max_grad_norm)
        del batches
    profile = target_profile(cfg.memory, env["device"])
    budget, source = resolve_budget(cfg.memory, profile, env["device"])
    baseline = verdict(step, budget, source, micro, seq)
    n_params = sum(p.numel() for p in model.parameters())
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not baseline.fits:
        # What does not fit, from the estimator: the same step on fake tensors, broken down.
        est = estimate_policy(cfg, profile, "none", hf_config=config_from_dict(model_config))
        baseline.estimate = est.to_dict()
        baseline.message += "\n" + explain_oom(est, budget, source)
    if cfg.train.objective == "dpo":
        baseline.message += f" ({micro // ROWS_PER_PAIR} pairs a rank: chosen and rejected rows)"
    log.info("baseline probe: %s", baseline.message)
    return ProbeReport(environment=env, baseline=baseline.to_dict(), model_source=_source_name(cfg),
                       n_params=n_params, architecture=model_config)


# -- phase 2 ------------------------------------------------------------------------------------------
def plan_stack(cfg: MemfitConfig, probe_report: ProbeReport, resume: ResumePoint | None = None) -> PlanReport:
    """Choose the optimisation stack with the memory planner (or estimate a fixed memory.policy); a run like one
    before reuses its plan, a `resume` on the same target its training checkpoint's (planner/replan.py); stacks
    stopped at the memory limit before are ruled out (recovery.on_memory_limit leaner)."""
    device = probe_report.environment["device"]
    if cfg.memory.policy == "offload" and device["type"] != "cuda":
        make_policy("offload").apply(torch.nn.Linear(1, 1))  # raises the policy's own clear error
    profile = target_profile(cfg.memory, device)
    budget, source = resolve_budget(cfg.memory, profile, device)
    measured = measured_peaks_for(cfg)
    for m in measured:
        log.info("memory limit before: %s measured %.4g GB at step %d > limit %.4g GB (%s): planning leaner",
                 m.label(), m.measured_bytes / 1e9, m.step, m.limit_bytes / 1e9, m.limit_source)
    return plan_at_resume(resume, profile.name, cfg.distributed.world_size, budget, cfg.memory.budget_gb is not None,
                          measured, lambda: _planned(trained_as(cfg, resume), probe_report, profile, budget, source,
                                                     measured))


def _planned(cfg: MemfitConfig, probe_report: ProbeReport, profile: Any, budget: int | None, source: str,
             measured: list[Any]) -> PlanReport:
    """The planner's plan (or the plan cache's), logged, with the distributed strategy when several ranks."""
    cached = cache_path(cfg.run.work_dir, plan_key(cfg, profile, budget, source, probe_report.architecture, measured))
    report = load_plan(cached)
    if report is None:
        report = run_plan(cfg, probe_report, profile, budget, source, measured)
        store_plan(cached, report)
    log.info("optimisation stack: %s (%s)", report.description, report.reason)
    if report.evaluation:  # phase 5 on the same device: said now, not after hours of training
        (log.info if report.evaluation["fits"] else log.warning)("%s", report.evaluation["line"])
    log.info("memory plan candidates:\n%s", report.table_markdown)
    from memfit.distributed.planning import plan_distributed  # several ranks: the strategy, bytes per rank

    return plan_distributed(cfg, probe_report, report)


# -- phase 4, run before phases 2 and 3 -------------------------------------------------------------
# The loop starts from what recovery finds (the step, weights, optimizer and RNG states and MLflow run of the
# newest verified training checkpoint; none: step 0), and a resume on the same device reuses its plan.
def recover_training_checkpoint(cfg: MemfitConfig) -> ResumePoint:
    """Find the newest training checkpoint of this run that verifies, download it, check it is this run's."""
    store = open_checkpoint_store(cfg)
    store.check_writable()  # a missing bucket or bad credentials fail here, before any training
    manager = CheckpointIndex(store, keep_last=cfg.checkpoint.keep_last)
    point = ResumePoint(checkpoint_uri=cfg.checkpoint.uri)
    complete = manager.list()
    if not complete:
        return point
    if not cfg.checkpoint.resume:
        raise CheckpointError(f"checkpoint.uri {cfg.checkpoint.uri} already holds training checkpoints (newest "
                              f"step {complete[-1].step}) and checkpoint.resume is false; point checkpoint.uri "
                              "at an empty location or remove them (memfit checkpoints ls shows them)")
    dest = staging_dir(cfg, "resume")
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
    saved = loaded.state.get("plan")  # verified with the rest of state.json; absent in older checkpoints
    return point.model_copy(update={
        "step": loaded.step, "source_uri": loaded.info.uri, "local_dir": str(dest / loaded.info.prefix),
        "mlflow_run_id": loaded.state.get("mlflow_run_id"), "finished": loaded.step >= cfg.train.max_steps,
        "plan": PlanReport.model_validate(saved) if saved else None})


# -- phase 3 ------------------------------------------------------------------------------------------
def train(cfg: MemfitConfig, plan: PlanReport, resume: ResumePoint, probe_report: ProbeReport | None = None,
          attempt: AttemptReport | None = None) -> TrainReport:
    """Train to train.max_steps from the resume point, logging to the tracker and saving training checkpoints."""
    from memfit.training.loop import Trainer

    if resume.finished:
        log.info("run already finished at step %s (%s): not retraining", resume.step, resume.source_uri)
        return finished_train_report(cfg, resume)
    if cfg.distributed.world_size > 1:  # torchrun runs this same training on every rank
        from memfit.distributed.launch import train_distributed

        prepare_for_ranks(cfg)  # a preset and the packed rows made once, not by every rank at once
        return train_distributed(cfg, plan, resume, probe_report)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)
    model = build_training_model(cfg, inputs.model, plan)
    tracker = make_tracker(cfg.tracking, prestarted=True)
    run_id = tracker.start_run(cfg.run.name, run_id=resume.mlflow_run_id, tags=run_tags(device))
    manager = checkpoint_manager(cfg)
    try:
        # The trainer runs what the plan decided; the run's identity stays the user's config.
        trainer = Trainer(cfg, plan, model, data, device, tracker, manager, run_identity(cfg))
        if resume.local_dir:
            trainer.restore(Path(resume.local_dir))
            tracker.set_tags({"memfit.resumed_from_step": str(resume.step)})
            record_plan_at_resume(tracker, plan, resume.step)
            record_recovery(tracker, attempt, resume.step)
        if not resume.local_dir or not tracker.continued:
            # A fresh run, or a resume whose MLflow run is not in this store: the new run gets params and plan.
            log_run_start(tracker, cfg, plan, data, probe_report)
        save_request = threading.Event()
        log.info("training: steps %d to %d on %s, MLflow run %s", (resume.step or 0) + 1, cfg.train.max_steps,
                 device, run_id)
        with stop_on_signals() as stop, spot_watcher(cfg.checkpoint.spot, stop, save_request):
            result = trainer.fit(stop, save_request)
    except BaseException:
        tracker.end_run("FAILED")
        raise
    finally:
        manager.close()
    if result.memory_limit and result.steps < cfg.train.max_steps:
        tracker.end_run("KILLED")
        where = remember_memory_limit(cfg, plan, result.memory_limit_reading) if result.memory_limit_reading else []
        raise MemoryLimitError(f"{result.memory_limit} (training checkpoint {result.last_checkpoint_uri}"
                               + (f"; measured peak recorded in {where[0]}" if where else "") + ")")
    if result.preempted:
        took = stop.seconds_since_request() or 0.0
        grace = cfg.checkpoint.grace_seconds
        if took > grace:
            log.warning("the preemption save took %.1f s after the stop request, more than checkpoint.grace_seconds="
                        "%.0f: on a real preemption the machine may be gone before it commits", took, grace)
        tracker.set_tags({"memfit.status": "preempted", "memfit.preempted_by": result.preempt_reason or "?"})
        tracker.end_run("KILLED")
        raise Preempted(f"preempted at step {result.steps} ({result.preempt_reason}): training checkpoint "
                        f"{result.last_checkpoint_uri} committed {took:.1f} s after the stop request (grace "
                        f"{grace:.0f} s); run the same command again to resume")
    log_training_end(tracker, plan, probe_report, result.steps)
    return result.model_copy(update={"mlflow_run_id": run_id})


def record_recovery(tracker: Any, attempt: AttemptReport | None, resumed_step: int | None) -> None:
    """The run's record of this resume (cause, step, steps and seconds lost) as metrics and tags, at the step
    resumed from; `memfit status` and the MLflow UI read it back."""
    history = tracker.metric_history("loss") if tracker.continued else []
    last_logged = max((step for step, _ in history), default=None)
    metrics, tags = recovery_record(attempt.model_dump() if attempt else None, resumed_step, last_logged,
                                    attempt.previous_end if attempt else None, time.time())
    tracker.log_metrics(metrics, step=int(resumed_step or 0))
    tracker.set_tags(tags)
    log.info("recovery: resumed at step %s (%s)", resumed_step, tags[next(iter(tags))])


# -- phase 5 ------------------------------------------------------------------------------------------
def evaluate_and_release(cfg: MemfitConfig, train_report: TrainReport) -> ExportReport:
    """Load the final training checkpoint, evaluate, export SafeTensors + ONNX (verified), gate and register."""
    from memfit.evaluation.dtype import TORCH, device_twin, phase5_dtype
    from memfit.evaluation.review import generate_heldout, generate_samples, log_generations, perplexity
    from memfit.models.lora import adapted_from_state, is_adapted, merge_lora
    from memfit.release.adapter import ADAPTER_DIR, verify_adapter, write_adapter
    from memfit.release.from_checkpoint import config_from_checkpoint, parity_criteria, trained_quantize
    from memfit.release.publish import release
    from memfit.training.readout import evaluate_loss

    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)
    manager = checkpoint_manager(cfg)
    dest = staging_dir(cfg, "export-src")
    shutil.rmtree(dest, ignore_errors=True)
    final = manager.latest(dest)
    if final is None:
        raise CheckpointError(f"no complete training checkpoint under {cfg.checkpoint.uri} to export")
    # A LoRA run's training checkpoint holds its adapters: the base rebuilt as the planned run held it (its
    # saved plan says whether it was quantized), the adapters loaded (and saved alone when asked), then folded in.
    lora_cfg = config_from_checkpoint(final, final.info.uri).lora
    quantize = trained_quantize(lora_cfg, final)
    model = adapted_from_state(inputs.model, lora_cfg, final.model_state, f"training checkpoint {final.info.uri}",
                               quantize)
    adapter_dir = None
    if cfg.export.adapter and is_adapted(model):
        adapter_dir = write_adapter(model, inputs.tokenizer, Path(cfg.export.dir) / ADAPTER_DIR, inputs.source,
                                    quantize)
    elif cfg.export.adapter:
        log.warning("export.adapter: this run trained all weights (lora.enabled=auto chose a full fine-tune): "
                    "no adapter to export; the merged SafeTensors export is the model")
    peft = None
    if "gguf-adapter" in cfg.export.enabled_formats():  # llama.cpp's converter reads the peft folder
        from memfit.release.gguf_adapter import PeftSource

        if is_adapted(model):
            peft_dir = adapter_dir or write_adapter(model, inputs.tokenizer, staging_dir(cfg, "gguf-adapter-src"),
                                                    inputs.source, quantize)
            peft = PeftSource(str(peft_dir), inputs.source, quantize)
        else:
            log.warning("export.formats gguf-adapter: this run trained all weights (lora.enabled=auto chose a full "
                        "fine-tune): no adapter to export; export the model with gguf")
    model = merge_lora(model)
    # eval.dtype: fp32 on the device, or (auto, when fp32 would not fit) a 16-bit copy there, fp32 kept in host
    # memory: the exports are written from fp32 weights either way.
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"dtype": phase5_dtype(cfg, device, model)})})
    model.to(device=device if cfg.eval.dtype == "fp32" else "cpu", dtype=torch.float32)
    evaluated = model if cfg.eval.dtype == "fp32" else device_twin(model, device, TORCH[cfg.eval.dtype])
    adapter = (verify_adapter(adapter_dir, model, inputs.source, quantize, parity_criteria(cfg.export))
               if adapter_dir else None)
    val_loss = evaluate_loss(evaluated, data.val, cfg.train.micro_batch_size, device, "fp32", cfg.train.eval_batches,
                             fields=data.val_fields)
    ppl = perplexity(val_loss)
    samples = generate_samples(evaluated, inputs.tokenizer, cfg.eval.prompts, cfg.eval.max_new_tokens, device)
    heldout = generate_heldout(evaluated, inputs.tokenizer, data.heldout, cfg.eval.max_new_tokens, device)
    del evaluated  # the 16-bit copy's device memory goes before the exports; the fp32 model stays
    # In `memfit run` the tracking process phase 3 handed back (or the one started for this run): MLflow's work
    # (model logging, registry, plots) runs there, with the store already open; elsewhere, in this process.
    tracker = make_tracker(cfg.tracking, prestarted=True)
    run_id = tracker.start_run(cfg.run.name, run_id=train_report.mlflow_run_id or None)
    try:
        step = train_report.steps
        tracker.log_metrics({"val_loss": val_loss, "val_perplexity": ppl}, step=step)
        tracker.set_tags({"memfit.eval_dtype": cfg.eval.dtype})
        log_generations(tracker, samples, step)
        log_generations(tracker, heldout, step, "eval/heldout_generations.json")
        meta = scrub_obj({"source_checkpoint": final.info.uri, "mlflow_run_id": run_id, "step": final.step,
                          "model_source": _source_name(cfg), "run_name": cfg.run.name})
        report = release(cfg, tracker, model, inputs.tokenizer, meta,
                         {"val_loss": val_loss, "val_perplexity": ppl}, step, adapter,
                         (data.val, data.val_fields) if cfg.train.objective == "dpo" else None, peft=peft)
        tracker.end_run("FINISHED")
    except BaseException as err:
        if isinstance(err, MemfitError):  # the reviewer sees why phase 5 failed (e.g. the ONNX parity figure)
            try:
                tracker.set_tags({"memfit.error": str(err)[:4000]})
            except Exception:  # noqa: BLE001 - never hide the original error behind a tracking one
                log.warning("could not record the error on the run", exc_info=True)
        tracker.end_run("FAILED")
        raise
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    return report.model_copy(update={"final_val_loss": val_loss, "final_val_perplexity": ppl,
                                     "source_checkpoint": final.info.uri, "generations": samples})


# -- around the phases: a finished run's report, `memfit launch-node`, helpers ------------------------
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


def launch_node(cfg: MemfitConfig) -> TrainReport | None:
    """`memfit launch-node`: this machine's ranks of a multi-node run (node 0 runs the flow itself)."""
    from memfit.distributed.launch import train_distributed

    if cfg.distributed.world_size < 2:
        raise ConfigError("memfit launch-node is for multi-process runs: set distributed.nnodes / nproc_per_node")
    # The same plan as node 0 (a pure function of the config and this node's probe) and this node's own copy
    # of the training checkpoint to resume from.
    probe = check_environment_and_probe(cfg)
    resume = recover_training_checkpoint(cfg)
    plan = plan_stack(cfg, probe, resume)
    if resume.finished:
        log.info("run already finished at step %s: nothing to do on this node", resume.step)
        return None
    prepare_for_ranks(cfg)
    return train_distributed(cfg, plan, resume, None)


def _source_name(cfg: MemfitConfig) -> str:
    return cfg.model.name_or_path or f"preset:{cfg.model.preset}"
