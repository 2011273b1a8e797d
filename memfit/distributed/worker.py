"""What torchrun runs on every rank: `python -m memfit.distributed.worker JOB.json` (phase 3, one rank)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from memfit.config import MemfitConfig, from_dict
from memfit.errors import ConfigError, DistributedError, MemoryLimitError, Preempted
from memfit.files import write_json_atomic
from memfit.reports import PlanReport, ProbeReport, ResumePoint, TrainReport
from memfit.runtime.importing import collector_paused

log = logging.getLogger("memfit.distributed")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    for noisy in ("httpx", "alembic", "urllib3", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _agree(info: Any, job_plan: dict[str, Any], resume: ResumePoint) -> dict[str, Any]:
    """Every rank uses rank 0's plan, and every node must resume from the same step."""
    import torch.distributed as dist

    box: list[Any] = [job_plan if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    steps: list[Any] = [None] * info.world_size
    dist.all_gather_object(steps, resume.step)
    if len(set(steps)) > 1:
        raise DistributedError(f"the nodes recovered different training checkpoints (steps by rank: {steps}); "
                               "they must share one checkpoint.uri")
    return box[0]


def _run(job: Any, cfg: MemfitConfig, info: Any, stop: threading.Event, save_request: threading.Event
         ) -> TrainReport:
    from memfit import run_context
    from memfit.data.cache import cached_data
    from memfit.distributed.launch import REPORT_FILE, RUN_ID_FILE
    from memfit.distributed.strategies import DEEPSPEED_STRATEGIES, TORCH_STRATEGIES
    from memfit.runtime.env import default_threads, pin_threads
    from memfit.tracking import NullTracker, make_tracker
    from memfit.training.loop import Trainer

    d, jdir = cfg.distributed, Path(job.job_dir)
    # Ranks share the machine's cores: train.num_threads, else OMP_NUM_THREADS (run_torchrun sets it to an
    # even split unless it was set), else an even split.
    pin_threads(cfg.train.num_threads or default_threads(d.nproc_per_node))
    resume = ResumePoint(**job.resume)
    plan = PlanReport(**_agree(info, job.plan, resume))
    if plan.strategy not in (*TORCH_STRATEGIES, *DEEPSPEED_STRATEGIES):
        raise ConfigError(f"distributed.strategy: the plan chose {plan.strategy!r}, not a multi-process strategy")
    inputs = run_context.load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)
    model = run_context.build_training_model(cfg, inputs.model, plan)
    probe = ProbeReport(**job.probe) if job.probe else None
    tracker: Any = NullTracker()
    if info.is_main:  # MLflow from rank 0 only: one run, whatever the world size
        tracker = make_tracker(cfg.tracking)
        tags = {**run_context.run_tags(info.device), "memfit.world_size": str(info.world_size),
                "memfit.strategy": plan.strategy}
        tracker.start_run(cfg.run.name, run_id=resume.mlflow_run_id, tags=tags)
        (jdir / RUN_ID_FILE).write_text(str(tracker.run_id))
        if resume.local_dir:
            tracker.set_tags({"memfit.resumed_from_step": str(resume.step)})
            run_context.record_plan_at_resume(tracker, plan, resume.step)
        if not resume.local_dir or not tracker.continued:  # a new run (also: its old one is not in this store)
            run_context.log_run_start(tracker, cfg, plan, data, probe)
    # The ranks run what the plan decided, as one process does; the identity stays the user's.
    checkpointer = run_context.sharded_checkpointer(cfg, info.rank, info.world_size)
    try:
        trainer = Trainer(cfg, plan, model, data, info.device, tracker, checkpointer,
                          run_context.run_identity(cfg), _strategy(plan, info, cfg))
        if resume.local_dir:
            trainer.restore(Path(resume.local_dir))
            log.info("resumed from %s at step %d on %d ranks", resume.source_uri, trainer.step, info.world_size)
        result = trainer.fit(stop, save_request)
        checkpointer.close()
    except BaseException:
        # Bounded: torchrun stops the other ranks 30 s after the first one exits.
        checkpointer.drain(timeout_s=25.0)
        tracker.end_run("FAILED")
        raise
    if info.is_main:
        if result.preempted:
            tracker.set_tags({"memfit.status": "preempted"})
            tracker.end_run("KILLED")
        elif _memory_stopped(result, cfg):
            tracker.end_run("KILLED")  # the monitor tagged why; the launcher raises MemoryLimitError
        else:  # buffered metrics written before this process ends (it exits with os._exit)
            run_context.log_training_end(tracker, plan, probe, result.steps)
        report = {**result.model_dump(mode="json"), "mlflow_run_id": tracker.run_id, "world_size": info.world_size,
                  "strategy": plan.strategy}
        write_json_atomic(jdir / REPORT_FILE, report, indent=2, sort_keys=True)
        if d.nnodes > 1:  # the flow on node 0 reads it from the store when this is another node
            from memfit.distributed.launch import store_report_key

            run_context.open_checkpoint_store(cfg).put_bytes(store_report_key(cfg), json.dumps(report).encode())
    return result


def _strategy(plan: PlanReport, info: Any, cfg: MemfitConfig) -> Any:
    """The strategy the plan chose, for this rank."""
    from memfit.distributed.strategies import TORCH_STRATEGIES

    if plan.strategy in TORCH_STRATEGIES:
        from memfit.training.strategies import TorchDistributed

        return TorchDistributed(plan.strategy, info, plan.precision)
    from memfit.training.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(plan, info, cfg)


def _memory_stopped(result: TrainReport, cfg: MemfitConfig) -> bool:
    """The memory monitor stopped training before train.max_steps (exit code 76, as one process)."""
    return bool(result.memory_limit) and result.steps < cfg.train.max_steps


def _write_error(job_dir: Path, rank: int, err: BaseException) -> None:
    from memfit.distributed.launch import ERRORS_DIR

    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    payload = {"rank": rank, "type": type(err).__name__, "message": lines[0] if lines else type(err).__name__,
               "traceback": "".join(traceback.format_exception(err)[-12:]), "time": time.time()}
    try:
        (job_dir / ERRORS_DIR).mkdir(parents=True, exist_ok=True)
        write_json_atomic(job_dir / ERRORS_DIR / f"rank-{rank:05d}.json", payload, indent=2, sort_keys=True)
    except OSError:
        pass  # the traceback is on stderr as well


def _exit(code: int, clean: bool) -> None:
    # gloo can abort at interpreter exit after destroy_process_group (FACTS): barrier, destroy, _exit.
    try:
        if clean:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    with collector_paused(freeze=True):  # this rank's start-up imports, _run's included (memfit/runtime/importing.py)
        from transformers.utils import logging as hf_logging

        import memfit.run_context  # noqa: F401
        import memfit.training.loop  # noqa: F401
        from memfit.distributed.launch import Job, mark_ready
        from memfit.distributed.strategies import init_process_group
        from memfit.runtime.preemption import save_on_signal, stop_on_signals
        from memfit.runtime.telemetry import set_telemetry_off

    args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(rank)
    set_telemetry_off()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise in the task log
    job = Job.read(Path(args[0]))
    try:
        cfg = from_dict(job.config, "job config")
        with stop_on_signals() as stop, save_on_signal() as save_request:
            mark_ready(Path(job.job_dir))  # from now on SIGUSR1 asks for a save instead of ending this process
            info = init_process_group(cfg.distributed.backend, cfg.train.device, cfg.distributed.timeout_minutes)
            result = _run(job, cfg, info, stop, save_request)
    except BaseException as err:
        log.error("rank %d failed: %s", rank, err, exc_info=not isinstance(err, (ConfigError,)))
        _write_error(Path(job.job_dir), rank, err)
        _exit(1, clean=False)  # no barrier: the other ranks fail on their next collective, torchrun stops them
        return
    stopped = MemoryLimitError.exit_code if _memory_stopped(result, cfg) else 0
    _exit(Preempted.exit_code if result.preempted else stopped, clean=True)


if __name__ == "__main__":
    main()
