"""The per-rank training loop: each rank's slice of every global micro-batch, one agreed stop flag per step."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import optim
from memfit.config import MemfitConfig
from memfit.data import BatchOrder, DataBundle
from memfit.dist_checkpoint import ShardedCheckpointer, load_into, rng_from_payload, rng_payload
from memfit.distributed.strategies import (
    RankInfo,
    check_same_weights,
    check_strategy,
    grad_norm_value,
    unwrap,
    wrap_ddp,
    wrap_fsdp2,
)
from memfit.memory.probe import autocast_context
from memfit.reports import TrainReport
from memfit.schedule import capture_rng, restore_rng, seed_everything
from memfit.tracking.base import Tracker
from memfit.train import evaluate_loss, fit_report, log_initial_val_loss

log = logging.getLogger("memfit.distributed")


def _test_fault(rank: int, step: int) -> None:
    # TEST-ONLY hook: MEMFIT_TEST_RANK_FAULT="<sigterm|crash>:<rank>:<step>" makes one rank receive SIGTERM
    # (as from a spot reclaim) or raise, right after that optimizer step, so tests hit the real paths.
    spec = os.environ.get("MEMFIT_TEST_RANK_FAULT")
    if not spec:
        return
    kind, r, s = spec.split(":")
    if int(r) == rank and int(s) == step:
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "crash":
            raise RuntimeError(f"injected crash on rank {rank} at step {step} (MEMFIT_TEST_RANK_FAULT)")


class DistTrainer:
    """One rank's model wrapper, optimizer, schedule and data position; `fit` trains to train.max_steps."""

    def __init__(self, cfg: MemfitConfig, strategy: str, precision: str, model: nn.Module, data: DataBundle,
                 info: RankInfo, tracker: Tracker, checkpointer: ShardedCheckpointer, identity: dict[str, Any]
                 ) -> None:
        check_strategy(strategy, precision)
        self.cfg, self.strategy, self.precision, self.data, self.info = cfg, strategy, precision, data, info
        self.tracker, self.checkpointer, self.identity = tracker, checkpointer, identity
        t = cfg.train
        check_same_weights(model, info)
        if precision == "bf16-true":
            model.to(torch.bfloat16)
        if strategy == "ddp":
            self.model = wrap_ddp(model, info)
        elif strategy == "fsdp2":
            self.model = wrap_fsdp2(model, info, precision)
        else:
            raise ValueError(f"DistTrainer runs ddp or fsdp2, not {strategy}")
        # FSDP2 computes in bf16 through its mixed-precision policy; DDP autocasts like one process does.
        self.autocast_precision = "fp32" if strategy == "fsdp2" and precision == "bf16-mixed" else precision
        self.optimizer = optim.make_adamw(self.model, t.lr, t.weight_decay)
        self.scheduler = optim.make_scheduler(self.optimizer, t)
        self.scaler = optim.make_scaler(info.device, precision)
        self._start_position()

    def _start_position(self) -> None:
        """Step 0 of the shared data order; this rank's slice of each micro-batch and its own RNG stream."""
        t = self.cfg.train
        self.order = BatchOrder(len(self.data.train), t.micro_batch_size, t.seed)
        self.per_rank = t.micro_batch_size // self.info.world_size
        self.step = 0
        self.tokens_seen = 0
        self.initial_val_loss: float | None = None
        self.resumed_from: int | None = None
        # Rank 0 draws what one process would (same seed); the others their own streams (dropout differs).
        seed_everything(t.seed + self.info.rank)

    # -- training checkpoints ------------------------------------------------------------------------
    def _resume_state(self) -> dict[str, Any]:
        rng_json, _ = capture_rng()
        return {"tokens_seen": self.tokens_seen, "data_order": self.order.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "rng": rng_json, "initial_val_loss": self.initial_val_loss, "mlflow_run_id": self.tracker.run_id,
                "identity": self.identity, "strategy": self.strategy}

    def save(self, blocking: bool) -> None:
        rng_json, rng_tensors = capture_rng()
        self.checkpointer.save(self.step, self.model, self.optimizer,
                               self._resume_state() if self.info.is_main else None, self.cfg.to_yaml(),
                               rng_payload(rng_json, rng_tensors), blocking=blocking)

    def restore(self, folder: Path) -> None:
        """Collective: load a sharded (any world size) or single-process training checkpoint."""
        from memfit.dist_checkpoint import is_deepspeed_folder, is_sharded_folder

        if is_deepspeed_folder(folder):
            from memfit.errors import CheckpointError

            raise CheckpointError(f"{folder}: a DeepSpeed training checkpoint; resume it with the DeepSpeed "
                                  "strategy and world size that wrote it")
        if is_sharded_folder(folder):
            state, rng = load_into(folder, self.model, self.optimizer, self.info.rank)
        else:
            state, rng = self._restore_single(folder)
        optim.restore_schedule(self.scheduler, self.scaler, state)
        self.order.load_state_dict(state["data_order"])
        self.step = int(state["step"])
        if rng is not None:
            restore_rng(*rng_from_payload(rng))
        else:  # this rank did not exist in the saved run: a fresh stream, distinct per rank and step
            seed_everything(self.cfg.train.seed + 7919 * self.info.rank + self.step)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.initial_val_loss = state.get("initial_val_loss")
        self.resumed_from = self.step

    def _restore_single(self, folder: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """A single-process training checkpoint scaled out: full tensors, positional optimizer state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_state_dict,
        )

        from memfit.checkpointing import read_checkpoint_folder

        ckpt = read_checkpoint_folder(folder)
        # Positions -> names, through this optimizer's groups (built by the same param_groups rule).
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        saved = ckpt.optimizer_state
        names = [fqn for g in groups for fqn in g["params"]]
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        if len(names) != len(ids):
            from memfit.errors import CheckpointError

            raise CheckpointError(f"{folder}: the optimizer state has {len(ids)} parameters, this model "
                                  f"{len(names)}; it is another model's training checkpoint")
        by_name = {names[k]: saved["state"][i] for k, i in enumerate(ids) if i in saved["state"]}
        named_groups = [{**sg, "params": g["params"]} for sg, g in zip(saved["param_groups"], groups, strict=True)]
        set_state_dict(self.model, self.optimizer, model_state_dict=dict(ckpt.model_state),
                       optim_state_dict={"state": by_name, "param_groups": named_groups},
                       options=StateDictOptions(full_state_dict=True))
        rng = rng_payload(ckpt.state["rng"], ckpt.rng_tensors) if self.info.is_main else None
        return ckpt.state, rng

    # -- steps ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        # Every rank evaluates the same batches (FSDP2 forwards are collective); the result is identical.
        return evaluate_loss(unwrap(self.model), self.data.val, self.cfg.train.micro_batch_size, self.info.device,
                             self.autocast_precision, self.cfg.train.eval_batches)

    def _optimizer_step(self) -> tuple[torch.Tensor, float]:
        t, lo = self.cfg.train, self.info.rank * self.per_rank
        loss_sum = torch.zeros((), device=self.info.device)
        for k in range(t.grad_accum_steps):
            # The same global order on every rank; each takes its contiguous slice of the micro-batch.
            idx = self.order.next_indices()[lo:lo + self.per_rank]
            batch = self.data.train[idx].to(self.info.device, non_blocking=True)
            last = k == t.grad_accum_steps - 1
            # DDP: all-reduce once per optimizer step, not per micro-batch.
            sync = nullcontext() if last or self.strategy != "ddp" else self.model.no_sync()
            with sync:
                with autocast_context(self.info.device, self.autocast_precision):
                    loss = self.model(input_ids=batch, labels=batch).loss / t.grad_accum_steps
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach().float()
        self.tokens_seen += t.micro_batch_size * t.grad_accum_steps * self.data.train.shape[1]
        norm = optim.apply_gradients(self.model, self.optimizer, self.scheduler, self.scaler, t.max_grad_norm)
        self.step += 1
        return loss_sum, grad_norm_value(norm)

    def fit(self, stop: threading.Event, save_request: threading.Event | None = None) -> TrainReport:
        """Train to train.max_steps. Each step one all-reduce carries the loss and two flags: any rank told to
        stop (all save and end) and any rank asked for a save (a spot rebalance notice: all save, go on)."""
        import torch.distributed as dist

        t, ck = self.cfg.train, self.cfg.checkpoint
        start = self.step
        log_initial_val_loss(self)
        tokens_per_step = t.batch_size * self.data.train.shape[1]
        last_loss: float | None = None
        peak_mem, run_tokens, preempted = 0, 0, False
        run_t0 = time.perf_counter()
        while self.step < t.max_steps:
            t0 = time.perf_counter()
            self.model.train()
            loss_sum, grad_norm = self._optimizer_step()
            _test_fault(self.info.rank, self.step)
            # One collective per step: the global mean loss, whether any rank was told to stop or to save.
            asked = save_request is not None and save_request.is_set()
            if asked:
                save_request.clear()  # type: ignore[union-attr]
            flags = torch.stack([loss_sum, torch.tensor(float(stop.is_set()), device=loss_sum.device),
                                 torch.tensor(float(asked), device=loss_sum.device)])
            dist.all_reduce(flags)
            last_loss = float(flags[0]) / self.info.world_size
            agreed_stop, agreed_save = float(flags[1]) > 0, float(flags[2]) > 0
            dt = time.perf_counter() - t0
            run_tokens += tokens_per_step
            if self.step % t.log_every_steps == 0 or self.step == t.max_steps:
                memory = optim.memory_now(self.info.device)
                peak_mem = max(peak_mem, memory[0])
                self.tracker.log_metrics(optim.step_metrics(last_loss, self.scheduler.get_last_lr()[0], grad_norm,
                                                      tokens_per_step, dt, memory), step=self.step)
            if self.info.is_main and (self.step % max(1, t.max_steps // 10) == 0 or self.step == t.max_steps):
                log.info("step %d/%d: loss %.4f, %.0f tokens/s on %d ranks", self.step, t.max_steps, last_loss,
                         tokens_per_step / dt, self.info.world_size)
            self.checkpointer.raise_if_failed()  # a failed background upload fails the run now
            if agreed_stop:
                preempted = True
                log.warning("rank %d: stop agreed at step %d (a rank received a stop signal): saving",
                            self.info.rank, self.step)
                break
            if (self.step % ck.every_steps == 0 or agreed_save) and self.step < t.max_steps:
                if agreed_save:
                    log.info("rank %d: save requested at step %d (spot rebalance recommendation)", self.info.rank,
                             self.step)
                self.save(blocking=False)
        # The final (or preemption) save is synchronous: the processes end right after it.
        self.save(blocking=True)
        self.tracker.flush()
        return fit_report(self, start, preempted, last_loss, peak_mem, run_tokens, time.perf_counter() - run_t0,
                          self.checkpointer.committed_uri())
