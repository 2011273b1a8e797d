"""The training loop, the only one: micro-batches, accumulation, agreement, metrics, training checkpoints."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from memfit.config import MemfitConfig
from memfit.data.order import BatchOrder
from memfit.data.packing import flattened, row_real_tokens
from memfit.data.pairs import with_rejected_side
from memfit.data.prepare import DataBundle
from memfit.distributed.strategies import unwrap
from memfit.memory.estimator.step import train_step
from memfit.memory.planner.monitor import MemoryMonitor
from memfit.memory.techniques.loss import Batch, LossPolicy, blocks_batch
from memfit.memory.techniques.optim import cuda_flops, memory_now
from memfit.memory.techniques.schedule import restore_rng, seed_everything
from memfit.models import experts
from memfit.reports import PlanReport, TrainReport
from memfit.runtime.env import keep_heap
from memfit.tracking.base import Tracker
from memfit.training.compile import CompileClock
from memfit.training.objective import make_objective
from memfit.training.readout import StepLog, attention_implementation, evaluate_loss, reads_padding
from memfit.training.strategies import Agreement, SingleProcess

log = logging.getLogger("memfit.train")


def _test_fault(rank: int, step: int) -> None:
    # TEST-ONLY hook: MEMFIT_TEST_RANK_FAULT="<sigterm|crash|kill>:<rank>:<step>" makes one rank receive SIGTERM
    # (as from a spot reclaim), raise, or die by SIGKILL right after that optimizer step (real paths in tests).
    # MEMFIT_TEST_STEP_DELAY=<seconds> makes every step that much slower: a slow machine whose run cannot end before
    # a test has started the next machine, however loaded the test machine is.
    if delay := os.environ.get("MEMFIT_TEST_STEP_DELAY"):
        time.sleep(float(delay))
    spec = os.environ.get("MEMFIT_TEST_RANK_FAULT")
    if not spec:
        return
    kind, r, s = spec.split(":")
    if int(r) == rank and int(s) == step:
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "crash":
            raise RuntimeError(f"injected crash on rank {rank} at step {step} (MEMFIT_TEST_RANK_FAULT)")


class Trainer:
    """One run's (one rank's) optimizer, schedule, data order and step counter; `fit` trains to max_steps.

    What differs between one process, DDP, FSDP2 and DeepSpeed is the strategy's (training/strategies.py);
    when to save is the checkpointer's (checkpoints/writer.py `due`); the rest is here, once.
    """

    def __init__(self, cfg: MemfitConfig, plan: PlanReport, model: nn.Module, data: DataBundle,
                 device: torch.device, tracker: Tracker, checkpoints: Any, identity: dict[str, Any],
                 strategy: SingleProcess | None = None) -> None:
        # The config for what was asked (steps, schedule, data, saves); the plan for what was decided (precision,
        # micro-batch and accumulation, loss, optimizer): training checkpoints save both.
        self.cfg, self.plan, self.data, self.device = cfg, plan, data, device
        self.tracker, self.checkpoints, self.identity = tracker, checkpoints, identity
        self.strategy = strategy or SingleProcess(device, plan.precision)
        self.strategy.prepare(model, cfg.train, plan)
        s = self.strategy
        self.model, self.optimizer, self.scheduler, self.scaler = s.model, s.optimizer, s.scheduler, s.scaler
        t = cfg.train
        self.step = 0
        self.tokens_seen = 0
        self.initial_val_loss: float | None = None
        self.resumed_from: int | None = None
        self.monitor = MemoryMonitor.for_run(cfg, device, tracker, *s.monitored())
        # train.objective: sft is the loss policy; dpo takes its reference here, before the first step (objective.py).
        self.loss: LossPolicy = make_objective(cfg, self.model, data, device, s.autocast_precision,
                                               getattr(checkpoints, "store", None), s.eval_model(), plan)
        self.attn_implementation = attention_implementation(model)
        self.trained_tokens_seen = 0
        # Trained tokens per training row, counted once here: a step adds up Python ints (no tensor read per step).
        # Plain blocks train every prediction: counted from the shape, so memory-mapped rows are not all read.
        labels = data.train_fields.get("labels")
        self._row_trained: list[int] = ((labels[:, 1:] != -100).sum(dim=1).tolist() if labels is not None
                                        else [data.train.shape[1] - 1] * len(data.train))
        self._row_real = row_real_tokens(data.train, data.train_fields, data.stats.get("pad_id"))
        self._row_trained, self._row_real = with_rejected_side(data.train_fields, self._row_trained, self._row_real)
        self._cut_to_longest = "attention_mask" in data.train_fields  # blocks_batch cuts such batches
        self.padding_mask = reads_padding(model)  # blocks_batch drops a padded row's mask unless the loss reads it
        # One padded example a row: micro-batches of similar lengths, so cutting to the longest leaves little padding.
        grouped = self._cut_to_longest and cfg.data.group_by_length
        self.order = BatchOrder(len(data.train), plan.micro_batch_size, t.seed, self._row_real if grouped else None)
        # data.streaming: the blocks come from the stream (plain blocks: every row full), its position checkpointed.
        self.feed = data.stream if data.stream is not None else self.order
        self.flatten = flattened(cfg.data, "position_ids" in data.train_fields, self.attn_implementation)
        self.step_counts = (0, 0, 0)  # the last step's (real, trained, computed) tokens on this rank
        self.flops = cuda_flops(self.model, device, data.train.shape[1], plan.precision)
        self.compile_clock = CompileClock(cfg.train.compile)
        seed_everything(t.seed + s.seed_offset())

    # -- state --------------------------------------------------------------------------------------------
    def resume_state(self, rng_json: dict[str, Any]) -> dict[str, Any]:
        """What every training checkpoint holds besides tensors (the strategy adds its own keys)."""
        return {"tokens_seen": self.tokens_seen, "data_order": self.feed.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "rng": rng_json, "initial_val_loss": self.initial_val_loss, "mlflow_run_id": self.tracker.run_id,
                "identity": self.identity, "plan": self.plan.model_dump(mode="json")}

    # What a training checkpoint holds of the model: all weights; with adapters (LoRA) only the trainable
    # ones (the frozen base, 16-bit or 4-bit, comes from model.name_or_path or the preset).
    def model_state(self) -> dict[str, torch.Tensor]:
        from memfit.models.lora import trainable_state

        return trainable_state(self.model)

    def load_model_state(self, state: Any) -> None:
        from memfit.models.lora import load_trainable_state

        load_trainable_state(self.model, state)

    def restore(self, folder: str | Path) -> None:
        """Resume from a local training checkpoint folder (collective with several ranks)."""
        state, rng = self.strategy.restore(self, Path(folder))
        self.feed.load_state_dict(state["data_order"])
        self.step = int(state["step"])
        if rng is not None:
            restore_rng(*rng)
        else:  # this rank did not exist in the saved run: a fresh stream, distinct per rank and step
            seed_everything(self.cfg.train.seed + 7919 * self.strategy.rank + self.step)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.initial_val_loss = state.get("initial_val_loss")
        self.resumed_from = self.step

    # -- evaluation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> float:
        # Every rank evaluates the same batches (FSDP2 forwards are collective); the result is identical.
        # dpo: the held-out pairs' loss, rewards and accuracies logged as val_* (objective.py)
        with getattr(self.loss, "measuring", lambda *_: contextlib.nullcontext())(self.tracker, self.step):
            return evaluate_loss(self.strategy.eval_model(), self.data.val, self.plan.micro_batch_size,
                                 self.device, self.strategy.autocast_precision,
                                 max_batches or self.cfg.train.eval_batches, self.loss, self.data.val_fields,
                                 self.attn_implementation)

    def log_initial_val_loss(self) -> None:
        """The validation loss before the first step (MLflow step 0), once per run: a resumed run keeps its own."""
        if self.initial_val_loss is None:
            self.initial_val_loss = self.evaluate()
            self.tracker.log_metrics({"val_loss": self.initial_val_loss,
                                      "val_perplexity": math.exp(min(self.initial_val_loss, 50))}, step=0)

    # -- training -----------------------------------------------------------------------------------------
    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor | float]:
        """One optimizer step over grad_accum_steps micro-batches; (this rank's loss, global grad norm)."""
        p, s = self.plan, self.strategy
        counts = [0, 0, 0]  # this step's real, trained and computed tokens on this rank
        loss_sum = train_step(self.model, self._batches(counts), s.autocast_precision, self.loss, p.grad_accum_steps,
                              backward=s.backward, micro_batch=s.micro_batch, divide=s.divides_loss,
                              total=torch.zeros((), device=self.device))
        self.tokens_seen += p.micro_batch_size * p.grad_accum_steps * self.data.train.shape[1]
        self.step_counts = (counts[0], counts[1], counts[2])
        grad_norm = s.optimizer_step(self.cfg.train.max_grad_norm)
        self.step += 1
        return loss_sum, grad_norm

    def _batches(self, counts: list[int]) -> Iterator[Batch]:
        """This rank's micro-batches of the next step, drawn as the step asks for them, their tokens counted."""
        p = self.plan
        for _ in range(p.grad_accum_steps):
            # The same global order on every rank; each takes its slice of the micro-batch.
            if self.data.stream is not None:
                train = self.data.stream.next_blocks(p.micro_batch_size)
                idx = self.strategy.shard(torch.arange(len(train)), p.micro_batch_size)
                lengths, row_trained = [train.shape[1]] * len(idx), (train.shape[1] - 1) * len(idx)
            else:
                train = self.data.train
                idx = self.strategy.shard(self.order.next_indices(), p.micro_batch_size)
                rows = [int(i) for i in idx]
                lengths = [self._row_real[i] for i in rows]
                row_trained = sum(self._row_trained[i] for i in rows)
            counts[0] += sum(lengths)
            counts[1] += row_trained
            counts[2] += (sum(lengths) if self.flatten else
                          len(idx) * (max(lengths) if self._cut_to_longest else self.data.train.shape[1]))
            self.trained_tokens_seen += row_trained
            yield blocks_batch(train, idx, self.device, self.data.train_fields, self.attn_implementation,
                               lengths if self.flatten else None, self.padding_mask)

    def save(self, blocking: bool, force: bool = False, deadline: float | None = None, busy: bool | None = None
             ) -> None:
        fut = self.strategy.save(self, blocking=blocking, force=force, deadline=deadline, busy=busy)
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

    def _log_routing(self) -> None:
        """MoE only: the router's auxiliary loss apart from the loss, and expert utilisation (min/max share)."""
        routing = getattr(self.loss, "last_routing", None)
        if routing is None:
            return
        aux, logits = routing
        top_k = getattr(getattr(self.model, "config", None), "num_experts_per_tok", None) or 1
        self.tracker.log_metrics({"router_aux_loss": float(aux), **experts.routing_stats(logits, top_k)},
                                 step=self.step)

    def _agree(self, loss_sum: torch.Tensor, stop: threading.Event | None,
               save_request: threading.Event | None) -> Agreement:
        asked = save_request is not None and save_request.is_set()
        if asked:
            save_request.clear()  # type: ignore[union-attr]
        return self.strategy.agree(loss_sum, stop=stop is not None and stop.is_set(), save=asked,
                                   memory=self.monitor.stop_requested, busy=self.checkpoints.busy)

    def fit(self, stop: threading.Event | None = None, save_request: threading.Event | None = None
            ) -> TrainReport:
        """Train to train.max_steps. `stop` (SIGTERM, spot notice) ends after the current step with a synchronous
        save; `save_request` (a rebalance recommendation) asks for a save now. With several ranks, any rank's
        stop, save request or memory limit holds for all (one all-reduce per step, with the loss)."""
        t, s = self.cfg.train, self.strategy
        start = self.step
        self.log_initial_val_loss()
        # Counted on this rank's rows; every rank takes an equal share of each batch, so x world_size is the step's.
        scale = s.world_size
        steplog, agreed = StepLog(self.tracker, self.device, s.world_size), None
        peak_mem, run_tokens, preempted, memory_stop = 0, 0, False, False
        run_trained = run_slots = 0
        run_t0 = time.perf_counter()
        bar = tqdm(total=t.max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if s.is_main else True, leave=False)
        release_heap = keep_heap()  # what a step frees stays mapped for the next (env.py)
        try:
            while self.step < t.max_steps:
                t0 = time.perf_counter()
                # train() walks every module (≈ 0.2 ms a step on the tiny model): only after an evaluation. A wrapper
                # (DDP, a DeepSpeed engine) is in train mode from birth while the model it holds is not (from_pretrained
                # and evaluation leave it in eval mode, where transformers skips gradient checkpointing): ask both.
                if not self.model.training or not unwrap(self.model).training:
                    self.model.train()
                with self.monitor.watch(self.step + 1):
                    loss_sum, grad_norm = self.optimizer_step()
                _test_fault(s.rank, self.step)
                agreed = self._agree(loss_sum, stop, save_request)
                dt = time.perf_counter() - t0
                real, trained, slots = (n * scale for n in self.step_counts)
                compiled = self.compile_clock.take()
                if compiled and s.is_main:
                    self.tracker.log_metrics(compiled, step=self.step)
                run_tokens, run_trained, run_slots = run_tokens + real, run_trained + trained, run_slots + slots
                if self.step % t.log_every_steps == 0 or self.step == t.max_steps:
                    memory = memory_now(self.device)
                    peak_mem = max(peak_mem, memory[0])
                    steplog.add(self.step, agreed.loss, grad_norm, lr=self.scheduler.get_last_lr()[0],
                                tokens=real, trained=trained, slots=slots, seconds=dt, memory=memory,
                                **self.flops)
                    self._log_routing()
                    if hasattr(self.loss, "pop_metrics"):  # dpo: TRL's rewards/* and logps/* since the last log
                        self.tracker.log_metrics(self.loss.pop_metrics(s.sum_over_ranks), step=self.step)
                bar.update(1)
                # The newest loss read, not this step's: reading it here would make every step wait.
                loss_shown = {} if steplog.last_loss is None else {"loss": f"{steplog.last_loss:.3f}"}
                bar.set_postfix(**loss_shown, trained_tok_s=f"{trained / dt:,.0f}", **self.monitor.postfix)
                if s.world_size > 1 and s.is_main and (self.step % max(1, t.max_steps // 10) == 0
                                                       or self.step == t.max_steps):
                    steplog.drain()
                    log.info("step %d/%d: loss %.4f, %.0f tokens/s on %d ranks", self.step, t.max_steps,
                             steplog.last_loss if steplog.last_loss is not None else math.nan,
                             real / dt, s.world_size)
                # A background save that failed fails the run here, not `every_steps` later.
                self.checkpoints.raise_if_failed()
                self._log_committed()
                agreed = s.settle(agreed, stop, save_request)
                if agreed.memory:
                    memory_stop = True
                    break  # saved below like a preemption; the caller turns it into MemoryLimitError
                if agreed.stop:
                    preempted = True
                    log.warning("rank %d: stop agreed at step %d: saving", s.rank, self.step)
                    break
                if self.checkpoints.due(self.step, last=self.step >= t.max_steps, requested=agreed.save):
                    if agreed.save:
                        log.info("rank %d: save requested at step %d (spot rebalance recommendation)", s.rank,
                                 self.step)
                    # Metrics up to a checkpoint are durable: after a SIGKILL the resumed run logs from there.
                    # The tracker writes them in its own thread; the checkpoint's commit waits for that write.
                    steplog.drain()
                    self.checkpoints.commit_after(self._flush_metrics())
                    self.save(blocking=False, force=agreed.save, busy=agreed.busy)  # written off the training thread
        finally:
            release_heap()
            self.compile_clock.close()
            bar.close()
            steplog.drain()
        if hasattr(self.loss, "measuring") and self.step > start:  # dpo: the held-out pairs after training
            self.evaluate()
        # The last step's loss, logged or not (a stop may end on a step that does not log): one read per run.
        last_loss = float(agreed.loss) / s.world_size if agreed is not None else None
        seconds = time.perf_counter() - run_t0
        self._save_last(stop if preempted else None)
        return TrainReport(
            mlflow_run_id=self.tracker.run_id or "", start_step=start, steps=self.step,
            resumed_from=self.resumed_from, preempted=preempted, initial_val_loss=self.initial_val_loss,
            final_train_loss=last_loss, tokens_per_s=run_tokens / seconds if run_tokens else None,
            trained_tokens_per_s=run_trained / seconds if run_tokens else None,
            padding_fraction=1.0 - run_tokens / run_slots if run_slots else None, peak_memory_bytes=peak_mem,
            last_checkpoint_uri=self.checkpoints.latest_uri(),
            preempt_reason=getattr(stop, "reason", None) if preempted else None,
            checkpoint_stats=self.checkpoints.stats.to_dict(), memory_limit=self._memory_message() if memory_stop
            else None, memory_limit_reading=self._memory_reading() if memory_stop else None)

    def _flush_metrics(self) -> Any:
        """Hand the buffered metrics to the tracker's writer without waiting (a Future), where it has one."""
        flush_async = getattr(self.tracker, "flush_async", None)  # the null tracker has nothing to write
        if flush_async is None:
            self.tracker.flush()
            return None
        return flush_async()

    def _save_last(self, stop: threading.Event | None) -> None:
        """The final (or preemption) save is synchronous: the process may end right after it. On preemption its
        retries must end within the grace period that is left."""
        requested_at = getattr(stop, "requested_at", None)
        deadline = requested_at + self.cfg.checkpoint.grace_seconds if requested_at is not None else None
        if self.checkpoints.last_step == self.step:
            self.checkpoints.wait()  # this very step is already saved or being saved
        else:
            self.save(blocking=True, deadline=deadline)
        self._log_committed()
        self.tracker.flush()

    def _memory_reading(self) -> dict[str, Any] | None:
        r = self.monitor.stop_reading  # None on a rank whose own peak stayed under (another rank's stopped it)
        return None if r is None else {"step": r.step, "peak_bytes": r.peak_bytes, "budget_bytes": r.budget_bytes,
                                       "budget_source": self.monitor.budget.source, "measure": r.measure}

    def _memory_message(self) -> str:
        if self.monitor.stop_message:
            return self.monitor.stop_message
        return (f"the memory peak on another rank passed monitor.stop_at_fraction at step {self.step} (its log has "
                "the figures): stopped with a training checkpoint instead of running out of memory")
