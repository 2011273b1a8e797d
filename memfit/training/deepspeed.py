"""DeepSpeed ZeRO-2/3 as a strategy of the one loop: the engine owns accumulation, clipping and precision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from memfit.checkpoints.format import (
    DEEPSPEED_CONFIG_FILE,
    DEEPSPEED_FORMAT,
    MODEL_FILE,
    STATE_FILE,
    is_deepspeed_folder,
    rng_file,
    rng_from_payload,
    rng_payload,
)
from memfit.config import TrainConfig
from memfit.errors import CheckpointError, ConfigError
from memfit.memory.techniques.optim import lr_schedule, param_groups
from memfit.memory.techniques.schedule import capture_rng
from memfit.training.strategies import RNG, TorchDistributed

_TAG = "ds"  # DeepSpeed writes <staging>/<tag>/...; the files are uploaded flat


def _owner(name: str) -> int | None:
    """Which rank uploads a DeepSpeed file: zero_pp_rank_<r>_... is rank r's; the rest is rank 0's (None)."""
    marker = "zero_pp_rank_"
    if marker in name:
        rest = name.split(marker, 1)[1]
        return int(rest.split("_", 1)[0])
    return None


class DeepSpeedStrategy(TorchDistributed):
    """ZeRO ranks: the same slices, agreement and checkpoint protocol as DDP / FSDP2, through the engine."""

    def __init__(self, plan: Any, info: Any, cfg: Any) -> None:
        super().__init__("ddp", info, plan.precision)  # the checks and the agreement of a torch rank
        self.name, self.plan, self.cfg = plan.strategy, plan, cfg
        self.autocast_precision = "fp32"  # DeepSpeed casts the module itself (bf16 / fp16 sections)

    def prepare(self, model: nn.Module, t: TrainConfig, plan: Any = None) -> None:
        from memfit.distributed.ds_config import config_for, import_deepspeed
        from memfit.distributed.strategies import check_same_weights
        from memfit.models.loading import find_decoder_blocks

        if self.plan.optimizer not in ("auto", "adamw"):
            raise ConfigError(f"memory.optimizer: {self.plan.optimizer} with {self.name}: the DeepSpeed engine "
                              "steps its own AdamW (CPU offload: distributed.offload_optimizer); set it to auto")
        self.in_backward = None

        deepspeed = import_deepspeed()
        check_same_weights(model, self.info)
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)  # buckets sized to the model
        self.ds_config = config_for(self.cfg, self.plan, num_layers=len(find_decoder_blocks(model)),
                                    hidden_size=hidden if isinstance(hidden, int) else None)
        model.to(self.device)
        sched = lr_schedule(t)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, t.weight_decay), config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, sched), dist_init_required=False)
        self.scaler = None

    def eval_model(self) -> nn.Module:
        return self.model  # through the engine: ZeRO-3 gathers each block's parameters for the forward

    def monitored(self) -> tuple[nn.Module, Any]:
        return self.model.module, self.optimizer

    divides_loss = False  # the engine scales by 1 / gradient_accumulation_steps itself

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        self.model.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
        self.model.step()  # optimizer, scheduler and zero_grad run at the accumulation boundary
        return loss.detach().float() / self.ds_config["gradient_accumulation_steps"]

    def optimizer_step(self, max_grad_norm: float | None) -> float:
        norm = self.model.get_global_grad_norm()  # the engine stepped at the boundary; clipping is in its config
        return float(norm) if norm is not None else float("nan")

    def resume_state(self, common: dict[str, Any]) -> dict[str, Any]:
        state = {k: v for k, v in common.items() if k not in ("scheduler", "scaler")}  # the engine saves those
        return {"checkpoint_format": DEEPSPEED_FORMAT, **state, "strategy": self.name}

    def save(self, trainer: Any, *, blocking: bool, force: bool, deadline: float | None, busy: bool | None
             ) -> Any:
        rng_json, _ = capture_rng()
        state = self.resume_state(trainer.resume_state(rng_json)) if self.is_main else None
        return trainer.checkpoints.save(trainer.step, lambda local: self._write(local, trainer.step), state,
                                        trainer.cfg.to_yaml(), lambda: rng_payload(*capture_rng()),
                                        blocking=blocking, force=force, deadline=deadline, busy=busy)

    def _write(self, local: Path, step: int) -> tuple[Path, list[Path], dict[str, Any]]:
        self.model.save_checkpoint(str(local), tag=_TAG, save_latest=False)  # collective: each rank its part
        written = local / _TAG
        # DeepSpeed's own files only (*.pt): other ranks of this node add their RNG files here meanwhile.
        mine = [p for p in sorted(written.glob("*.pt"))
                if _owner(p.name) == self.rank or (_owner(p.name) is None and self.is_main)]
        # Whole 16-bit weights on rank 0 for phase 5 (ZeRO-3 gathers them: collective).
        if self.ds_config["zero_optimization"]["stage"] == 3:
            full = self.model._zero3_consolidated_16bit_state_dict()
        else:
            full = self.model.module.state_dict() if self.is_main else None
        if self.is_main:
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in full.items()},
                      str(written / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
            (written / DEEPSPEED_CONFIG_FILE).write_text(json.dumps(self.ds_config, indent=2))
            mine += [written / MODEL_FILE, written / DEEPSPEED_CONFIG_FILE]
        return written, mine, {}

    def restore(self, trainer: Any, folder: Path) -> tuple[dict[str, Any], RNG | None]:
        if not is_deepspeed_folder(folder):
            raise CheckpointError(f"{folder}: not a DeepSpeed training checkpoint; resume it with the strategy that "
                                  "wrote it (distributed.strategy ddp or fsdp2, or one process)")
        state = json.loads((folder / STATE_FILE).read_text())
        if int(state.get("world_size", 0)) != self.world_size:
            raise CheckpointError(f"{folder}: written by {state.get('world_size')} DeepSpeed ranks, resumed on "
                                  f"{self.world_size}; ZeRO partitions only load on the same number of ranks")
        # DeepSpeed reads its own files (torch.load of its pickles): they were verified against the manifest.
        path, _ = self.model.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"{folder}: DeepSpeed could not load this training checkpoint")
        own = folder / rng_file(self.rank)
        return state, rng_from_payload(json.loads(own.read_text())) if own.is_file() else None
