"""The training loop: micro-batches, accumulation, clipping, schedule, metrics, training checkpoints."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch import nn
from tqdm.auto import tqdm

from memfit.checkpointing import CheckpointManager, LoadedCheckpoint, Snapshot, take_snapshot
from memfit.config import MemfitConfig
from memfit.data import BatchOrder, DataBundle
from memfit.memory.monitor import MemoryMonitor
from memfit.memory.probe import autocast_context
from memfit.schedule import capture_rng, lr_factor, restore_rng, seed_everything
from memfit.tracking.base import Tracker

log = logging.getLogger("memfit.train")


@dataclass
class TrainResult:
    start_step: int
    steps: int
    resumed_from: int | None
    preempted: bool
    initial_val_loss: float | None
    final_train_loss: float | None
    tokens_per_s: float | None
    peak_memory_bytes: int
    last_checkpoint_uri: str | None
    preempt_reason: str | None = None
    checkpoint_stats: dict[str, Any] | None = None


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # No decay on biases and norm weights (1-D): the usual AdamW recipe for transformers.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
        self.optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(
            lr_factor, warmup_steps=t.warmup_steps, max_steps=t.max_steps, min_ratio=t.min_lr_ratio))
        self.scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16-mixed" else None
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
        sched = dict(state["scheduler"])
        sched.pop("lr_lambdas", None)  # ours is rebuilt from the config (max_steps may have grown)
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **sched})
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
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
    def _memory_now(self) -> tuple[int, int]:
        """(peak since last call, current) bytes: the CUDA allocator on GPU, process RSS on CPU."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(peak), int(torch.cuda.memory_allocated(self.device))
        rss = psutil.Process().memory_info().rss
        return int(rss), int(rss)

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
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = t.max_grad_norm if t.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
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
            ) -> TrainResult:
        """Train to train.max_steps; `stop` (SIGTERM, spot notice) ends after the current step with a
        synchronous save; `save_request` (a rebalance recommendation) asks for a save now."""
        t, ck = self.cfg.train, self.cfg.checkpoint
        start = self.step
        if self.initial_val_loss is None:
            self.initial_val_loss = self.evaluate()
            self.tracker.log_metrics({"val_loss": self.initial_val_loss,
                                      "val_perplexity": math.exp(min(self.initial_val_loss, 50))}, step=0)
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
                    peak, current = self._memory_now()
                    peak_mem = max(peak_mem, peak)
                    self.tracker.log_metrics({
                        "loss": last_loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                        "memory_peak_bytes": peak, "memory_current_bytes": current,
                    }, step=self.step)
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
        elapsed = time.perf_counter() - run_t0
        latest = self.checkpoints.list()
        return TrainResult(
            start_step=start, steps=self.step, resumed_from=self.resumed_from, preempted=preempted,
            initial_val_loss=self.initial_val_loss, final_train_loss=last_loss,
            tokens_per_s=(run_tokens / elapsed) if run_tokens else None, peak_memory_bytes=peak_mem,
            last_checkpoint_uri=latest[-1].uri if latest else None,
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
