"""The objective policy: what a micro-batch's loss is (sft: the loss policy; dpo: preference pairs), chosen once."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.data.pairs import REJECTED
from memfit.distributed.strategies import sharded_parameters, unwrap
from memfit.errors import ConfigError
from memfit.memory.techniques.logps import first_predicting, keeps_logits, sequence_logps
from memfit.memory.techniques.loss import Batch, LossPolicy, blocks_batch, make_loss

log = logging.getLogger("memfit.train")
# A preference batch: the chosen side under the usual names (input_ids, labels, attention_mask), the rejected side
# under REJECTED + name, and with dpo.reference precompute the reference's summed log-probs per pair.
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


def concatenated(batch: Batch) -> Batch:
    """Chosen rows then rejected rows in one batch (the two sides already padded to the same width)."""
    out = {k: torch.cat([batch[k], batch[REJECTED + k]]) for k in ("input_ids", "labels", "attention_mask")
           if k in batch}
    return out


def policy_logps(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, completion tokens) of chosen + rejected rows, [2 x pairs] each, from ONE forward.
    The head runs only from the first position that predicts a completion token in any row (transformers'
    logits_to_keep, where the model takes it): a prompt's logits are never read, and over a large vocabulary they
    are most of a pair's logits (their log-softmax, its memory and its backward too)."""
    both = concatenated(batch)
    labels = both.pop("labels")
    start = first_predicting(labels) if keeps_logits(model) else 0
    if start == 0:
        return sequence_logps(model(**both, use_cache=False).logits, labels)
    logits = model(**both, use_cache=False, logits_to_keep=labels.shape[1] - start).logits
    return sequence_logps(logits, labels[:, start:])


class Reference:
    """Where the reference log-probs come from; `logps(model, batch)` → (summed, counts) like policy_logps."""

    name = "none"

    def logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None


class AdapterOff(Reference):
    """The policy with its LoRA adapters disabled (peft's disable_adapter): the base it started from, no copy.
    `model`: the peft model itself when the policy is wrapped (DDP), whose wrapper has no disable_adapter."""

    name = "adapter_off"

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model

    @torch.no_grad()
    def logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model if self.model is not None else model
        with model.disable_adapter():
            return policy_logps(model, batch)


class FrozenCopy(Reference):
    """A frozen copy of the starting model, kept here (never in the trained model, so never in its state)."""

    name = "copy"

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(unwrap(model)).eval().requires_grad_(False)

    @torch.no_grad()
    def logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return policy_logps(self.model, batch)


class Precomputed(Reference):
    """Log-probs stored beside the data before training (ref_* fields of the batch)."""

    name = "precompute"

    def logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        summed = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
        counts = torch.cat([batch["labels"], batch[REJECTED + "labels"]])[:, 1:].ne(-100).sum(-1)
        return summed, counts


def dpo_losses(loss_type: str, beta: float, label_smoothing: float, simpo_gamma: float, chosen: torch.Tensor,
               rejected: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor] | None = None,
               ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward) from summed completion log-probs (simpo: per-token means),
    `counts` the completion tokens of each side (ipo averages the log-ratios per token, as TRL does); reference
    log-probs are None for the reference-free simpo."""
    def smoothed(logits: torch.Tensor) -> torch.Tensor:  # conservative DPO: label_smoothing of the pairs flipped
        return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing

    if loss_type == "simpo":  # TRL's CPO loss_type simpo, cpo_alpha 0: rewards are beta x the mean log-probs
        return smoothed((chosen - rejected) - simpo_gamma / beta), beta * chosen.detach(), beta * rejected.detach()
    assert ref_chosen is not None and ref_rejected is not None
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "ipo":
        assert counts is not None
        delta = chosen_ratio / counts[0].clamp(min=1) - rejected_ratio / counts[1].clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:  # sigmoid: the DPO paper's
        losses = smoothed(chosen_ratio - rejected_ratio)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


class DpoObjective:
    """DPO-family loss of preference pairs: chosen and rejected in one forward, the reference as configured.

    Called like a loss policy (model, batch) → the mean loss over the batch's pairs; the TRL-named metrics of
    every call are summed on the device and read by `pop_metrics` only when the loop logs.
    """

    name = "dpo"

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 simpo_gamma: float = 0.5, reference: Reference | None = None) -> None:
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.simpo_gamma = simpo_gamma
        self.reference = reference or Reference()
        self._sums: dict[str, torch.Tensor] = {}
        self._pairs = 0
        self._evaluating = False

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        summed, counts = policy_logps(model, batch)
        pairs = summed.shape[0] // 2
        mean = summed / counts.clamp(min=1)
        sides = (counts[:pairs], counts[pairs:])
        if self.loss_type == "simpo":
            losses, r_chosen, r_rejected = dpo_losses("simpo", self.beta, self.label_smoothing, self.simpo_gamma,
                                                      mean[:pairs], mean[pairs:])
            logps = mean.detach()  # TRL's CPO logs the log-probs its loss uses: the per-token means
        else:
            ref = self.reference.logps(model, batch)
            if ref is None:
                raise ValueError(f"dpo.loss_type {self.loss_type} needs reference log-probs (dpo.reference)")
            ref_summed = ref[0].detach()
            losses, r_chosen, r_rejected = dpo_losses(self.loss_type, self.beta, self.label_smoothing,
                                                      self.simpo_gamma, summed[:pairs], summed[pairs:], sides,
                                                      ref_summed[:pairs], ref_summed[pairs:])
            logps = summed.detach()
        self._record(losses.detach(), r_chosen, r_rejected, logps, mean.detach(), pairs)
        if self._evaluating:  # val_loss stays what phase 5 reports: next-token loss of the chosen completions
            return -summed[:pairs].sum() / counts[:pairs].sum().clamp(min=1)
        return losses.mean()

    def _record(self, losses: torch.Tensor, r_chosen: torch.Tensor, r_rejected: torch.Tensor, summed: torch.Tensor,
                mean: torch.Tensor, pairs: int) -> None:
        values = {"dpo_loss": losses, "rewards/chosen": r_chosen, "rewards/rejected": r_rejected,
                  "rewards/accuracies": (r_chosen > r_rejected).float(), "rewards/margins": r_chosen - r_rejected,
                  "logps/chosen": summed[:pairs], "logps/rejected": summed[pairs:],
                  # the policy alone ranks the pair by per-token log-prob: ~0.5 for a model that knows no preference
                  "preference_accuracy": (mean[:pairs] > mean[pairs:]).float()}
        for k, v in values.items():
            total = v.float().sum()
            self._sums[k] = self._sums[k] + total if k in self._sums else total
        self._pairs += pairs

    def pop_metrics(self, reduce: Any = None) -> dict[str, float]:
        """Means per pair since the last pop (one host read for all), then reset. `reduce` sums a tensor over the
        ranks (each holds its share of every batch's pairs), called on every rank alike."""
        if not self._sums:
            self._pairs = 0
            return {}
        names = sorted(self._sums)
        totals = torch.stack([*(self._sums[k] for k in names),
                              torch.tensor(float(self._pairs), device=self._sums[names[0]].device)])
        if reduce is not None:
            totals = reduce(totals)
        values = totals.tolist()
        self._sums, self._pairs = {}, 0
        return {k: v / values[-1] for k, v in zip(names, values[:-1], strict=True)} if values[-1] else {}

    @contextlib.contextmanager
    def measuring(self, tracker: Any, step: int) -> Iterator[None]:
        """An evaluation: its metrics apart from the training steps' running sums, logged as val_* at `step` (the
        DPO loss as val_dpo_loss); each call inside returns the chosen completions' next-token loss instead."""
        saved, self._sums, self._pairs = (self._sums, self._pairs), {}, 0
        self._evaluating = True
        try:
            yield
            metrics = self.pop_metrics()
            tracker.log_metrics({f"val_{k}": v for k, v in metrics.items()}, step=step)
            log.info("validation pairs at step %d: dpo loss %.4f, preference accuracy %.3f, rewards/accuracies %.3f",
                     step, metrics["dpo_loss"], metrics["preference_accuracy"], metrics["rewards/accuracies"])
        finally:
            self._sums, self._pairs = saved
            self._evaluating = False


@torch.no_grad()
def precompute_reference(model: nn.Module, data: Any, batch_size: int, device: torch.device, precision: str,
                         store: Any = None) -> None:
    """dpo.reference precompute: one pass over the training and validation pairs before the first step; the
    model's (the reference's) summed log-probs stored beside the pairs as ref_* fields, so no reference model is
    held while training and the batches carry them in the data order. With the training-checkpoint `store` the
    values are kept there too, keyed by the pairs and the starting weights: a restarted run reads them back."""
    from memfit.memory.estimator.probe import autocast_context
    from memfit.training import reference_cache

    key = reference_cache.cache_key(model, data, batch_size, precision) if store is not None else None
    if key is not None and reference_cache.agreed(reference_cache.load(store, key, data, REFERENCE_KEYS)):
        log.info("dpo.reference precompute: reference log-probs of %d training + %d validation pairs read from "
                 "%s/%s (kept by an earlier attempt)", len(data.train), len(data.val), store.uri.rstrip("/"), key)
        return
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    for rows, fields in ((data.train, data.train_fields), (data.val, data.val_fields)):
        chosen, rejected = [], []
        for i in range(0, len(rows), batch_size):
            batch = blocks_batch(rows, slice(i, i + batch_size), device, fields)
            with autocast_context(device, precision):
                summed, _ = policy_logps(model, batch)
            n = summed.shape[0] // 2
            chosen.append(summed[:n].float().cpu())
            rejected.append(summed[n:].float().cpu())
        fields[REFERENCE_KEYS[0]], fields[REFERENCE_KEYS[1]] = torch.cat(chosen), torch.cat(rejected)
    model.train(was_training)
    log.info("dpo.reference precompute: reference log-probs of %d training + %d validation pairs in %.1f s",
             len(data.train), len(data.val), time.perf_counter() - t0)
    if key is not None:
        reference_cache.save(store, key, data, REFERENCE_KEYS)


def make_reference(setting: str, loss_type: str, model: nn.Module, coverage: float | None = None) -> Reference:
    """dpo.reference resolved on the model by estimator/preference.py's rule (auto: precompute when the run goes over
    its pairs at least once, else adapter_off for a peft model, else copy, or precompute for a sharded model);
    simpo needs none. `model` is the policy as it runs (DDP's inner module, the DeepSpeed engine)."""
    from memfit.memory.estimator.preference import reference_mode

    sharded = sharded_parameters(model)
    mode = reference_mode(setting, loss_type, hasattr(model, "disable_adapter"), coverage, sharded)
    if mode == "copy" and sharded:
        raise ConfigError("dpo.reference: copy is not supported with a sharded model (distributed.strategy fsdp2 or "
                          "deepspeed_zero3: each rank holds a slice); use precompute (or auto), or adapter_off with "
                          "LoRA")
    if setting == "auto" and sharded and mode == "precompute" and (coverage is None or coverage < 1.0):
        log.info("dpo.reference auto: a sharded model (FSDP2, ZeRO-3) is not copied: precompute instead")
    if mode == "none":
        return Reference()
    if mode == "adapter_off":
        if not hasattr(model, "disable_adapter"):
            raise ConfigError("dpo.reference: adapter_off needs LoRA adapters, and this run trains all weights "
                              "(lora.enabled auto chose full fine-tuning); set dpo.reference to auto, copy or "
                              "precompute, or lora.enabled: true")
        return AdapterOff(model)
    if mode == "precompute":
        return Precomputed()
    return FrozenCopy(model)


def make_objective(cfg: Any | None = None, model: nn.Module | None = None, data: Any = None,
                   device: torch.device | None = None, precision: str = "fp32", store: Any = None,
                   inner: nn.Module | None = None, plan: Any = None) -> LossPolicy:
    """The run's objective (the one place it is chosen): train.objective sft is the loss policy (memory.loss);
    dpo is a DpoObjective over `model`'s reference, taken here before the first step (the copy, or with
    precompute the log-probs stored beside `data`, and kept in the training-checkpoint `store`). `inner`: the
    policy without its DDP wrapper, which the reference is taken from and run as. `plan`: the loss, micro-batch
    and accumulation as planned (the PlanReport)."""
    if cfg is None or cfg.train.objective == "sft":
        return make_loss(cfg, plan.loss if plan is not None else None)
    d, t = cfg.dpo, cfg.train
    covered = None
    if data is not None and len(data.train):
        from memfit.memory.estimator.preference import coverage

        # Pairs a step over all ranks: each rank takes its share of every micro-batch (Trainer.train_step).
        micro, accum = (plan.micro_batch_size, plan.grad_accum_steps) if plan is not None else \
            (t.micro_batch_size, t.grad_accum_steps)
        covered = coverage(t.max_steps, micro * accum, len(data.train))
    model = inner if inner is not None else model
    reference = make_reference(d.reference, d.loss_type, model, covered) if model is not None else Reference()
    if d.reference == "auto" and model is not None and d.loss_type != "simpo":
        log.info("dpo.reference auto: %s (max_steps x pairs a step cover the %s training pairs %s times; "
                 "precompute from one full pass up, or on a sharded model)", reference.name,
                 len(data.train) if data is not None else "?",
                 f"{covered:.2f}" if covered is not None else "an unknown number of")
    if reference.name == "precompute" and model is not None and data is not None:
        precompute_reference(model, data, plan.micro_batch_size if plan is not None else t.micro_batch_size,
                             device or torch.device("cpu"), precision, store)
    return DpoObjective(d.beta, d.loss_type, d.label_smoothing, d.simpo_gamma, reference)
