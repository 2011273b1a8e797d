"""What the loop reads back from the device: the logged steps' loss and norm without a wait; the validation loss."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from memfit.memory.estimator.probe import autocast_context
from memfit.memory.techniques.loss import Batch, LossPolicy, blocks_batch, make_loss, trained_tokens
from memfit.memory.techniques.optim import step_metrics
from memfit.tracking.base import Tracker


class StepLog:
    """The metrics of the steps that log, with their loss and gradient norm read to the host without making a
    step wait for the device: on CUDA a non-blocking copy and an event per logged step, turned into floats
    (and logged) once the copy has landed; elsewhere at once. No step reads a device value it does not log."""

    MAX_PENDING = 8  # logged steps whose values may still be in flight; past that the oldest is waited for

    def __init__(self, tracker: Tracker, device: torch.device, world_size: int) -> None:
        self.tracker, self.device, self.world_size = tracker, device, world_size
        self._pending: deque[tuple[int, Any, Any, dict[str, Any]]] = deque()
        self.last_loss: float | None = None  # the newest loss read (the progress bar's)

    def add(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | float, **metrics: Any) -> None:
        """Step `step`'s loss (summed over ranks) and norm; `metrics`: step_metrics' other arguments."""
        if self.device.type == "cuda":
            norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=loss_sum.device)
            values = torch.stack([loss_sum.float(), norm.float()]).to("cpu", non_blocking=True)  # pinned
            event = torch.cuda.Event()
            event.record()
        else:
            values, event = (loss_sum, grad_norm), None
        self._pending.append((step, values, event, metrics))
        self.drain(keep=self.MAX_PENDING)

    def drain(self, keep: int = 0) -> None:
        """Log every step whose values have landed; wait for the oldest while more than `keep` are left."""
        while self._pending:
            step, values, event, metrics = self._pending[0]
            if event is not None and not event.query():
                if len(self._pending) <= keep:
                    return
                event.synchronize()
            self._pending.popleft()
            loss, norm = (float(v) for v in values)
            self.last_loss = loss / self.world_size
            self.tracker.log_metrics(step_metrics(self.last_loss, grad_norm=norm, **metrics), step=step)


def _config(model: nn.Module) -> Any:
    return getattr(getattr(model, "module", model), "config", None)  # DDP and DeepSpeed wrap the model in .module


def reads_padding(model: nn.Module) -> bool:
    """Whether padded rows keep their mask for this model (models/experts.keeps_padding_mask: an MoE's
    load-balancing loss counts the real tokens by it); any other causal LM gets the same logits without it."""
    from memfit.models.experts import keeps_padding_mask

    return keeps_padding_mask(_config(model))


def attention_implementation(model: nn.Module) -> str:
    """The attention kernel family the model runs (sdpa, eager, flash_attention_2, ...): packed batches follow it."""
    return str(getattr(_config(model), "_attn_implementation", None) or "sdpa")


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int, device: torch.device,
                  precision: str = "fp32", max_batches: int = 8, loss_fn: LossPolicy | None = None,
                  fields: dict[str, torch.Tensor] | None = None, attn_implementation: str | None = None) -> float:
    """Mean loss per trained token over the first `max_batches` validation batches (a fixed subset, so runs
    compare); `fields` are the validation rows' labels / position_ids / attention_mask."""
    loss_fn = loss_fn or make_loss()
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, min(len(blocks), batch_size * max_batches), batch_size):
        batch: Batch = blocks_batch(blocks, slice(i, i + batch_size), device, fields,
                                    attn_implementation or attention_implementation(model),
                                    padding_mask=reads_padding(model))
        with autocast_context(device, precision):
            loss = loss_fn(model, batch)
        n = trained_tokens(batch)  # the loss is a mean over these: weight each batch by them
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)
