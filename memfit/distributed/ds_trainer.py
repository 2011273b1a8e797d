"""DeepSpeed ZeRO-2/3 ranks: the engine from the generated JSON config, the same loop and agreed stop."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.config import MemfitConfig
from memfit.data import DataBundle
from memfit.dist_checkpoint import (
    DEEPSPEED_CONFIG_FILE,
    DEEPSPEED_FORMAT,
    ShardedCheckpointer,
    is_deepspeed_folder,
    rng_file,
    rng_from_payload,
    rng_payload,
)
from memfit.distributed.ds_config import config_for, import_deepspeed
from memfit.distributed.strategies import RankInfo, check_same_weights
from memfit.distributed.trainer import DistTrainer
from memfit.errors import CheckpointError
from memfit.optim import lr_schedule, param_groups
from memfit.schedule import capture_rng, restore_rng
from memfit.tracking.base import Tracker
from memfit.train import evaluate_loss

log = logging.getLogger("memfit.distributed")
_TAG = "ds"  # DeepSpeed writes <staging>/<tag>/...; the files are uploaded flat


class DeepSpeedTrainer(DistTrainer):
    """DistTrainer's loop over a DeepSpeed engine (which owns accumulation, clipping and precision)."""

    def __init__(self, cfg: MemfitConfig, plan: Any, model: nn.Module, data: DataBundle, info: RankInfo,
                 tracker: Tracker, checkpointer: ShardedCheckpointer, identity: dict[str, Any]) -> None:
        deepspeed = import_deepspeed()
        from memfit.modeling import find_decoder_blocks

        self.cfg, self.strategy, self.precision, self.data, self.info = cfg, plan.strategy, plan.precision, data, info
        self.tracker, self.checkpointer, self.identity = tracker, checkpointer, identity
        t = cfg.train
        check_same_weights(model, info)
        self.ds_config = config_for(cfg, plan, num_layers=len(find_decoder_blocks(model)))
        model.to(info.device)
        sched = lr_schedule(t)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, t.weight_decay), config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, sched), dist_init_required=False)
        self.autocast_precision = "fp32"  # DeepSpeed casts the module itself (bf16 / fp16 sections)
        self.scaler = None
        self._start_position()

    @torch.no_grad()
    def evaluate(self) -> float:
        # Through the engine: ZeRO-3 gathers each block's parameters for the forward.
        return evaluate_loss(self.model, self.data.val, self.cfg.train.micro_batch_size, self.info.device,
                             "fp32", self.cfg.train.eval_batches)

    def _optimizer_step(self) -> tuple[torch.Tensor, float]:
        t, lo = self.cfg.train, self.info.rank * self.per_rank
        loss_sum = torch.zeros((), device=self.info.device)
        for _ in range(t.grad_accum_steps):
            idx = self.order.next_indices()[lo:lo + self.per_rank]
            batch = self.data.train[idx].to(self.info.device)
            loss = self.model(input_ids=batch, labels=batch).loss
            self.model.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
            self.model.step()  # optimizer, scheduler and zero_grad run at the accumulation boundary
            loss_sum += loss.detach().float() / t.grad_accum_steps
        self.tokens_seen += t.micro_batch_size * t.grad_accum_steps * self.data.train.shape[1]
        self.step += 1
        norm = self.model.get_global_grad_norm()
        return loss_sum, float(norm) if norm is not None else float("nan")

    def _resume_state(self) -> dict[str, Any]:
        rng_json, _ = capture_rng()
        return {"checkpoint_format": DEEPSPEED_FORMAT, "tokens_seen": self.tokens_seen,
                "data_order": self.order.state_dict(), "rng": rng_json, "initial_val_loss": self.initial_val_loss,
                "mlflow_run_id": self.tracker.run_id, "identity": self.identity, "strategy": self.strategy}

    def save(self, blocking: bool) -> None:
        from safetensors.torch import save_file

        prefix, save_id, local = self.checkpointer.begin(self.step)
        self.model.save_checkpoint(str(local), tag=_TAG, save_latest=False)  # collective: each rank its part
        written = local / _TAG
        # DeepSpeed's own files only (*.pt): other ranks of this node add their RNG files here meanwhile.
        mine = [p for p in sorted(written.glob("*.pt"))
                if _owner(p.name) == self.info.rank or (_owner(p.name) is None and self.info.is_main)]
        # Whole 16-bit weights on rank 0 for phase 5 (ZeRO-3 gathers them: collective).
        if self.ds_config["zero_optimization"]["stage"] == 3:
            full = self.model._zero3_consolidated_16bit_state_dict()
        else:
            full = self.model.module.state_dict() if self.info.is_main else None
        if self.info.is_main:
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in full.items()},
                      str(written / "model.safetensors"), metadata={"format": "pt", "step": str(self.step)})
            (written / DEEPSPEED_CONFIG_FILE).write_text(json.dumps(self.ds_config, indent=2))
            mine += [written / "model.safetensors", written / DEEPSPEED_CONFIG_FILE]
        rng_json, rng_tensors = capture_rng()
        self.checkpointer.finish(self.step, prefix, save_id, written, mine, rng_payload(rng_json, rng_tensors),
                                 self._resume_state() if self.info.is_main else None, self.cfg.to_yaml(), blocking)

    def restore(self, folder: Path) -> None:
        if not is_deepspeed_folder(folder):
            raise CheckpointError(f"{folder}: not a DeepSpeed training checkpoint; resume it with the strategy that "
                                  "wrote it (distributed.strategy ddp or fsdp2, or one process)")
        state = json.loads((folder / "state.json").read_text())
        if int(state.get("world_size", 0)) != self.info.world_size:
            raise CheckpointError(f"{folder}: written by {state.get('world_size')} DeepSpeed ranks, resumed on "
                                  f"{self.info.world_size}; ZeRO partitions only load on the same number of ranks")
        # DeepSpeed reads its own files (torch.load of its pickles): they were verified against the manifest.
        path, _ = self.model.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"{folder}: DeepSpeed could not load this training checkpoint")
        self.order.load_state_dict(state["data_order"])
        self.step = int(state["step"])
        own = folder / rng_file(self.info.rank)
        if own.is_file():
            restore_rng(*rng_from_payload(json.loads(own.read_text())))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.initial_val_loss = state.get("initial_val_loss")
        self.resumed_from = self.step


def _owner(name: str) -> int | None:
    """Which rank uploads a DeepSpeed file: zero_pp_rank_<r>_... is rank r's; the rest is rank 0's (None)."""
    marker = "zero_pp_rank_"
    if marker in name:
        rest = name.split(marker, 1)[1]
        return int(rest.split("_", 1)[0])
    return None
