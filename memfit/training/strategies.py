"""What differs between one process, DDP and FSDP2 (DeepSpeed: deepspeed.py), behind the loop's one interface."""

from __future__ import annotations

import contextlib
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.checkpoints.format import (
    is_deepspeed_folder,
    is_sharded_folder,
    rng_from_payload,
    rng_payload,
    take_snapshot,
)
from memfit.checkpoints.manager import CheckpointManager
from memfit.checkpoints.reader import read_checkpoint_folder
from memfit.checkpoints.sharded import ShardedCheckpointer, dcp_shards, load_into
from memfit.config import TrainConfig
from memfit.errors import CheckpointError, ConfigError
from memfit.memory.techniques import optim
from memfit.memory.techniques.schedule import capture_rng
from memfit.models import experts
from memfit.reports import PlanReport

RNG = tuple[dict[str, Any], dict[str, Any]]  # (JSON-able python/numpy states, torch tensors)


@dataclass(frozen=True)
class Agreement:
    """What every rank agrees on after a step: the mean loss, and whether any rank must stop or save."""

    loss: torch.Tensor  # this step's loss summed over ranks, still on the device: read only when logged
    stop: bool = False  # a stop signal or spot notice: save and end (preempted)
    save: bool = False  # a save request (spot rebalance): save and go on
    memory: bool = False  # the memory monitor's hard limit: save and end (MemoryLimitError)
    busy: bool = False  # a rank's previous save is still uploading (checkpoint.on_busy decides)


class SingleProcess:
    """One process: the model as it is, autocast per the precision, a GradScaler for fp16."""

    name = "single"
    rank, world_size = 0, 1

    def __init__(self, device: torch.device, precision: str = "fp32") -> None:
        self.device, self.precision = device, precision
        self.autocast_precision = precision
        self.model: nn.Module
        self.optimizer: Any
        self.scheduler: Any
        self.scaler: torch.amp.GradScaler | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- set-up ----------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, t: TrainConfig, plan: PlanReport) -> None:
        """Place (and wrap) the model; the optimizer, schedule and loss scaler over what the ranks hold: precision,
        AdamW variant and stepping in backward as the plan decided them."""
        if plan.precision == "bf16-true":
            model.to(torch.bfloat16)
        experts.apply(model, "train", self.device.type)  # MoE only: what this device and dtype can run
        self.model = self._wrap(model)
        self.optimizer_kind = self._optimizer_kind(plan.optimizer)
        # Stepping in backward as planned; the config refused what it cannot do.
        # With the CPU-offloaded AdamW torchao frees each gradient on the GPU instead (the step stays on the CPU).
        in_backward = plan.optimizer_in_backward
        offloaded = self.optimizer_kind == "adamw-cpu-offload"
        self.optimizer = optim.make_adamw(self.model, t.lr, t.weight_decay, kind=self.optimizer_kind,
                                          offload_gradients=in_backward and offloaded)
        self.scheduler = optim.make_scheduler(self.optimizer, t)
        self.scaler = optim.make_scaler(self.device, plan.precision)
        self.in_backward = optim.StepInBackward(self.optimizer) if in_backward and not offloaded else None

    def _optimizer_kind(self, setting: str) -> str:
        return optim.resolve_optimizer(setting, self.device.type)

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def seed_offset(self) -> int:
        # Rank 0 draws what one process would (same seed); the others their own streams (dropout differs).
        return self.rank

    def eval_model(self) -> nn.Module:
        return self.model

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """A tensor summed over every rank (called on all of them alike); one process: itself."""
        return values

    def monitored(self) -> tuple[nn.Module, Any]:
        """The module and optimizer whose tensors the memory monitor counts."""
        return self.model, self.optimizer

    # -- one step ----------------------------------------------------------------------------------------
    def shard(self, indices: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        """This rank's contiguous slice of a global micro-batch (all of it with one process)."""
        per_rank = micro_batch_size // self.world_size
        return indices[self.rank * per_rank:(self.rank + 1) * per_rank]

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward (DDP: no all-reduce but on the last)."""
        return nullcontext()

    # The step (estimator/step.py train_step) divides each micro-batch's loss by the accumulation steps first.
    divides_loss = True

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of one micro-batch's share of the step's loss; returns that share (detached)."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach().float()

    def optimizer_step(self, max_grad_norm: float | None) -> torch.Tensor | float:
        """Clip, step, advance the schedule; the global gradient norm before clipping (a device tensor: the
        loop reads it only when it logs, so a step waits for no device)."""
        if self.in_backward is not None:  # every parameter stepped in backward already, its gradient freed
            self.scheduler.step()
            return self.in_backward.finish()
        norm = optim.apply_gradients(self.model, self.optimizer, self.scheduler, self.scaler, max_grad_norm)
        full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor whose full value is the global norm
        return full() if callable(full) else norm

    def agree(self, loss_sum: torch.Tensor, stop: bool, save: bool, memory: bool, busy: bool) -> Agreement:
        return Agreement(loss_sum, stop, save, memory, busy)

    def settle(self, agreed: Agreement, stop: Any, save_request: Any) -> Agreement:
        """The flags as the loop acts on them. One process needs no agreement: a stop or save request that
        arrived while the step was logged counts at once (several ranks keep what they agreed)."""
        late_save = save_request is not None and save_request.is_set()
        if late_save:
            save_request.clear()
        return replace(agreed, stop=agreed.stop or (stop is not None and stop.is_set()), save=agreed.save or late_save)

    # -- training checkpoints ----------------------------------------------------------------------------
    def resume_state(self, common: dict[str, Any]) -> dict[str, Any]:
        return common

    def save(self, trainer: Any, *, blocking: bool, force: bool, deadline: float | None, busy: bool | None
             ) -> Any:
        ckpt: CheckpointManager = trainer.checkpoints
        # Taken by the writer only if the save goes ahead (on_busy=skip may drop it).
        return ckpt.save(lambda: self.snapshot(trainer), blocking=blocking, force=force, deadline=deadline,
                         step=trainer.step, busy=busy)

    def snapshot(self, trainer: Any) -> Any:
        """This step's training checkpoint in memory (weights, optimizer, RNG, schedule), as a save takes it."""
        rng_json, rng_tensors = capture_rng()
        state = {"step": trainer.step, **self.resume_state(trainer.resume_state(rng_json))}
        return take_snapshot(trainer.step, trainer.model_state(), self.optimizer.state_dict(), rng_tensors, state,
                             trainer.cfg.to_yaml())

    def restore(self, trainer: Any, folder: Path) -> tuple[dict[str, Any], RNG | None]:
        """Weights, optimizer and schedule from a training checkpoint; returns (state.json, this rank's RNG)."""
        ckpt = read_checkpoint_folder(folder)
        trainer.load_model_state(ckpt.model_state)
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        optim.restore_schedule(self.scheduler, self.scaler, ckpt.state)
        return ckpt.state, (ckpt.state["rng"], ckpt.rng_tensors)


class TorchDistributed(SingleProcess):
    """DDP or FSDP2 ranks (torch.distributed): one all-reduce per step agrees on the loss and the flags."""

    def __init__(self, name: str, info: Any, precision: str) -> None:
        from memfit.distributed.strategies import check_strategy

        check_strategy(name, precision)
        super().__init__(info.device, precision)
        self.name, self.info = name, info
        self.rank, self.world_size = info.rank, info.world_size
        # FSDP2 computes in bf16 through its mixed-precision policy; DDP autocasts like one process does.
        self.autocast_precision = "fp32" if name == "fsdp2" and precision == "bf16-mixed" else precision

    def prepare(self, model: nn.Module, t: TrainConfig, plan: PlanReport) -> None:
        from memfit.distributed.strategies import check_same_weights

        check_same_weights(model, self.info)  # what every rank loaded, before any cast
        super().prepare(model, t, plan)

    def _optimizer_kind(self, setting: str) -> str:
        # DDP replicas step plain tensors (any variant); FSDP2 steps DTensor shards, which only torch's
        # default AdamW path is checked with here; the CPU-offload wrapper is for one GPU.
        kind = optim.resolve_optimizer(setting, self.device.type)
        if self.name == "fsdp2" and setting == "auto":
            return "adamw"
        allowed = ("adamw",) if self.name == "fsdp2" else ("adamw", "adamw-fused", "adamw-8bit")
        if kind not in allowed:
            raise ConfigError(f"memory.optimizer: {kind} is not supported with distributed.strategy {self.name}; "
                              f"choose {' or '.join(allowed)} (or auto)")
        return kind

    def _wrap(self, model: nn.Module) -> nn.Module:
        from memfit.distributed.strategies import wrap_ddp, wrap_fsdp2

        return wrap_ddp(model, self.info) if self.name == "ddp" else wrap_fsdp2(model, self.info, self.precision)

    def eval_model(self) -> nn.Module:
        return getattr(self.model, "module", self.model)  # DDP's inner module: no gradient hooks

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        # DDP: all-reduce once per optimizer step, not per micro-batch.
        return self.model.no_sync() if self.name == "ddp" and not last else nullcontext()

    def agree(self, loss_sum: torch.Tensor, stop: bool, save: bool, memory: bool, busy: bool) -> Agreement:
        import torch.distributed as dist

        dev = loss_sum.device
        flags = torch.stack([loss_sum, *(torch.tensor(float(f), device=dev) for f in (stop, save, memory, busy))])
        dist.all_reduce(flags)
        # The flags are read every step (every rank must act alike); the loss sum stays on the device.
        return Agreement(flags[0], *(f > 0 for f in flags[1:].tolist()))

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        values = values.clone()
        dist.all_reduce(values)
        return values

    def settle(self, agreed: Agreement, stop: Any, save_request: Any) -> Agreement:
        return agreed  # every rank acts on the same flags, or the collective saves would not match

    def resume_state(self, common: dict[str, Any]) -> dict[str, Any]:
        return {**common, "strategy": self.name}

    def save(self, trainer: Any, *, blocking: bool, force: bool, deadline: float | None, busy: bool | None
             ) -> Any:
        ckpt: ShardedCheckpointer = trainer.checkpoints
        rng_json, _ = capture_rng()
        state = self.resume_state(trainer.resume_state(rng_json)) if self.is_main else None
        return ckpt.save(trainer.step, dcp_shards(self.model, self.optimizer, self.rank), state,
                         trainer.cfg.to_yaml(), lambda: rng_payload(*capture_rng()), blocking=blocking, force=force,
                         deadline=deadline, busy=busy)

    def restore(self, trainer: Any, folder: Path) -> tuple[dict[str, Any], RNG | None]:
        """Collective: a sharded (any world size) or single-process training checkpoint."""
        if is_deepspeed_folder(folder):
            raise CheckpointError(f"{folder}: a DeepSpeed training checkpoint; resume it with the DeepSpeed "
                                  "strategy and world size that wrote it")
        if is_sharded_folder(folder):
            state, rng = load_into(folder, self.model, self.optimizer, self.rank)
        else:
            state, rng = self._restore_single(folder)
        optim.restore_schedule(self.scheduler, self.scaler, state)
        return state, rng_from_payload(rng) if rng is not None else None

    def _restore_single(self, folder: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """A single-process training checkpoint scaled out: full tensors, positional optimizer state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_state_dict,
        )

        ckpt = read_checkpoint_folder(folder)
        # Positions -> names, through this optimizer's groups (built by the same param_groups rule).
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        saved = ckpt.optimizer_state
        names = [fqn for g in groups for fqn in g["params"]]
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        if len(names) != len(ids):
            raise CheckpointError(f"{folder}: the optimizer state has {len(ids)} parameters, this model "
                                  f"{len(names)}; it is another model's training checkpoint")
        by_name = {names[k]: saved["state"][i] for k, i in enumerate(ids) if i in saved["state"]}
        named_groups = [{**sg, "params": g["params"]} for sg, g in zip(saved["param_groups"], groups, strict=True)]
        set_state_dict(self.model, self.optimizer, model_state_dict=dict(ckpt.model_state),
                       optim_state_dict={"state": by_name, "param_groups": named_groups},
                       options=StateDictOptions(full_state_dict=True))
        rng = rng_payload(ckpt.state["rng"], ckpt.rng_tensors) if self.is_main else None
        return ckpt.state, rng
