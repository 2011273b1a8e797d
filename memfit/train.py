"""The training loop: micro-batches, accumulation, clipping, schedule, metrics, training checkpoints."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from memfit.checkpointing import CheckpointManager, LoadedCheckpoint, Snapshot, take_snapshot
from memfit.config import MemfitConfig
from memfit.data import BatchOrder, DataBundle
from memfit.memory.monitor import MemoryMonitor
from memfit.memory.probe import autocast_context
from memfit.optim import (
    apply_gradients,
    make_adamw,
    make_scaler,
    make_scheduler,
    memory_now,
    restore_schedule,
    step_metrics,
)
from memfit.reports import TrainReport
from memfit.schedule import capture_rng, restore_rng, seed_everything
from memfit.tracking.base import Tracker

log = logging.getLogger("memfit.train")


def fit_report(trainer: Any, start: int, preempted: bool, last_loss: float | None, peak_mem: int, run_tokens: int,
               elapsed: float, last_checkpoint_uri: str | None, **extra: Any) -> TrainReport:
    """What a trainer's `fit` did, for the flow (single process, or rank 0 of several)."""
    return TrainReport(
        mlflow_run_id=trainer.tracker.run_id or "", start_step=start, steps=trainer.step,
        resumed_from=trainer.resumed_from, preempted=preempted, initial_val_loss=trainer.initial_val_loss,
        final_train_loss=last_loss, tokens_per_s=(run_tokens / elapsed) if run_tokens else None,
        peak_memory_bytes=peak_mem, last_checkpoint_uri=last_checkpoint_uri, **extra)


def log_initial_val_loss(trainer: Any) -> None:
    """The validation loss before the first step (MLflow step 0), once per run: a resumed run keeps its own."""
    if trainer.initial_val_loss is None:
        trainer.initial_val_loss = trainer.evaluate()
        trainer.tracker.log_metrics({"val_loss": trainer.initial_val_loss,
                                     "val_perplexity": math.exp(min(trainer.initial_val_loss, 50))}, step=0)


class Trainer:
    """One run's optimizer, schedule, data order and step counter; `fit` trains to train.max_steps."""

    def __init__(self, cfg: MemfitConfig, model: nn.Module, data: DataBundle, device: torch.device,
                 tracker: Tracker, checkpoints: CheckpointManager, identity: dict[str, Any]) -> None:
        self.cfg, self.model, self.data, self.device = cfg, model, data, device
        self.tracker, self.checkpoints, self.identity = tracker, checkpoints, identity
        t = cfg.train
        if t.precision == "bf16-true":
            model.to(torch.bfloat16)
        model.to(device)
        self.optimizer = make_adamw(model, t.lr, t.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, t)
        self.scaler = make_scaler(device, t.precision)
        self.order = BatchOrder(len(data.train), t.micro_batch_size, t.seed)
        self.step = 0
        self.tokens_seen = 0
        self.initial_val_loss: float | None = None
        self.resumed_from: int | None = None
        self.monitor = MemoryMonitor.for_run(cfg, device, tracker, model, self.optimizer)
        seed_everything(t.seed)

    # -- state --------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        rng_json, rng_tensors = capture_rng()
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data_order": self.order.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": rng_json,
            "initial_val_loss": self.initial_val_loss,
            "mlflow_run_id": self.tracker.run_id,
            "identity": self.identity,
        }
        return take_snapshot(self.step, self.model_state(), self.optimizer.state_dict(), rng_tensors,
                             state, self.cfg.to_yaml())

    # Hooks for what a training checkpoint holds of the model: all weights here; with adapters (LoRA) an
    # override returns and loads only the trainable ones (the frozen base comes from model.name_or_path).
    def model_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=True)

    def restore(self, ckpt: LoadedCheckpoint) -> None:
        state = ckpt.state
        self.load_model_state(ckpt.model_state)
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        restore_schedule(self.scheduler, self.scaler, state)
        self.order.load_state_dict(state["data_order"])
        restore_rng(state["rng"], ckpt.rng_tensors)
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.initial_val_loss = state.get("initial_val_loss")
        self.resumed_from = self.step

    # -- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> float:
        return evaluate_loss(self.model, self.data.val, self.cfg.train.micro_batch_size, self.device,
                             self.cfg.train.precision, max_batches or self.cfg.train.eval_batches)

    # -- training -----------------------------------------------------------------------------------
    def _optimizer_step(self) -> tuple[float, float]:
        t = self.cfg.train
        micro = t.micro_batch_size
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(t.grad_accum_steps):
            idx = self.order.next_indices()
            batch = self.data.train[idx].to(self.device, non_blocking=True)
            with autocast_context(self.device, t.precision):
                loss = self.model(input_ids=batch, labels=batch).loss / t.grad_accum_steps
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        self.tokens_seen += micro * t.grad_accum_steps * self.data.train.shape[1]
        grad_norm = apply_gradients(self.model, self.optimizer, self.scheduler, self.scaler, t.max_grad_norm)
        self.step += 1
        return float(loss_sum), float(grad_norm)

    def save(self, blocking: bool, force: bool = False, deadline: float | None = None) -> None:
        # The snapshot is taken by the manager only if the save goes ahead (on_busy=skip may drop it).
        fut = self.checkpoints.save(self.snapshot, blocking=blocking, force=force, deadline=deadline)
        rec = self.checkpoints.stats.last
        if fut is not None and rec is not None and rec.step == self.step:
            self.tracker.log_metrics({"checkpoint_stall_s": rec.stall_s, "checkpoint_snapshot_s": rec.snapshot_s},
                                     step=self.step)

    def _log_committed(self) -> None:
        for rec in self.checkpoints.completed():
            metrics = {"checkpoint_write_upload_s": rec.write_upload_s or 0.0, "checkpoint_bytes": rec.bytes or 0}
            if rec.upload_mb_per_s:
                metrics["checkpoint_upload_mb_per_s"] = rec.upload_mb_per_s
            self.tracker.log_metrics(metrics, step=rec.step)

    def fit(self, stop: threading.Event | None = None, save_request: threading.Event | None = None
            ) -> TrainReport:
        """Train to train.max_steps; `stop` (SIGTERM, spot notice) ends after the current step with a
        synchronous save; `save_request` (a rebalance recommendation) asks for a save now."""
        t, ck = self.cfg.train, self.cfg.checkpoint
        start = self.step
        log_initial_val_loss(self)
        tokens_per_step = t.batch_size * self.data.train.shape[1]
        last_loss: float | None = None
        peak_mem = 0
        run_t0, run_tokens = time.perf_counter(), 0
        preempted = False
        bar = tqdm(total=t.max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                   disable=None, leave=False)
        try:
            while self.step < t.max_steps:
                t0 = time.perf_counter()
                self.model.train()
                with self.monitor.watch(self.step + 1):
                    last_loss, grad_norm = self._optimizer_step()
                dt = time.perf_counter() - t0
                run_tokens += tokens_per_step
                if self.step % t.log_every_steps == 0 or self.step == t.max_steps:
                    memory = memory_now(self.device)
                    peak_mem = max(peak_mem, memory[0])
                    self.tracker.log_metrics(step_metrics(last_loss, self.scheduler.get_last_lr()[0], grad_norm,
                                                          tokens_per_step, dt, memory), step=self.step)
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                                **self.monitor.postfix)
                # A background save that failed fails the run here, not `every_steps` later.
                self.checkpoints.raise_if_failed()
                self._log_committed()
                if self.monitor.stop_requested:
                    break  # saved below like a preemption; the pipeline turns it into MemoryLimitError
                if stop is not None and stop.is_set():
                    preempted = True
                    break
                requested = save_request is not None and save_request.is_set()
                if requested:
                    save_request.clear()
                if (self.step % ck.every_steps == 0 or requested) and self.step < t.max_steps:
                    # Metrics up to a checkpoint are durable: after a SIGKILL the resumed run logs from there.
                    self.tracker.flush()
                    self.save(blocking=False, force=requested)  # written and uploaded off the training thread
        finally:
            bar.close()
        # The final (or preemption) save is synchronous: the process may end right after it. On preemption
        # its retries must end within the grace period that is left.
        deadline = None
        if preempted and getattr(stop, "requested_at", None) is not None:
            deadline = stop.requested_at + ck.grace_seconds  # type: ignore[union-attr]
        if self.checkpoints.last_step == self.step:
            self.checkpoints.wait()  # this very step is already saved or being saved
        else:
            self.save(blocking=True, deadline=deadline)
        self._log_committed()
        self.tracker.flush()
        latest = self.checkpoints.list()
        return fit_report(self, start, preempted, last_loss, peak_mem, run_tokens, time.perf_counter() - run_t0,
                          latest[-1].uri if latest else None,
                          preempt_reason=getattr(stop, "reason", None) if preempted else None,
                          checkpoint_stats=self.checkpoints.stats.to_dict())


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int, device: torch.device,
                  precision: str = "fp32", max_batches: int = 8) -> float:
    """Mean token loss over the first `max_batches` validation batches (a fixed subset, so runs compare)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, min(len(blocks), batch_size * max_batches), batch_size):
        batch = blocks[i:i + batch_size].to(device)
        with autocast_context(device, precision):
            loss = model(input_ids=batch, labels=batch).loss
        n = batch.numel()
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)
