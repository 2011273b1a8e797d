"""DPO in the plan: twice the rows a step (chosen and rejected) and the reference log-probs' cost, per mode."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

ROWS_PER_PAIR = 2  # chosen and rejected through the policy in one forward


def reference_mode(setting: str, loss_type: str, lora: bool, coverage: float | None = None,
                   sharded: bool = False) -> str:
    """Pure: dpo.reference as a run resolves it (objective.make_reference's rule): none for the reference-free
    simpo. auto is precompute when the run goes over its training pairs at least once (`coverage`, see below): a
    per-step reference would compute each pair's log-probs again every pass, precompute does it once and holds no
    reference while training. Below one pass (or unknown, as in a plan before the data is read) auto is
    adapter_off with LoRA adapters (no extra weights), else a frozen copy; but a model whose parameters are split
    over the ranks (`sharded`: FSDP2, ZeRO-3) is not copied, so there it is precompute."""
    if loss_type == "simpo":
        return "none"
    if setting == "auto":
        if coverage is not None and coverage >= 1.0:
            return "precompute"
        return "adapter_off" if lora else "precompute" if sharded else "copy"
    return setting


def coverage(max_steps: int, pairs_per_step: int, train_pairs: int) -> float:
    """Pure: how many times the run's steps go over the training pairs (max_steps x pairs a step / pairs). A
    per-step reference runs max_steps x pairs_per_step pair forwards; precompute runs train_pairs once."""
    return max_steps * pairs_per_step / max(train_pairs, 1)


def why(mode: str, copy_bytes: int) -> str:
    """One line for the plan: what the reference costs in this mode and what the alternative would."""
    gb = copy_bytes / 1e9
    return {
        "none": "simpo is reference-free: no reference log-probs",
        "adapter_off": "adapter_off: the policy with its LoRA adapters disabled is the reference: no extra "
                       "weights, one no-grad forward a step (precompute would move that forward before training; "
                       "auto takes it when max_steps go over the training pairs at least once)",
        "copy": f"copy: a frozen copy of the starting model, {gb:.3g} GB of weights and one no-grad forward a step; "
                "dpo.reference: precompute needs neither while training (one pass before step 1; auto takes it "
                "when max_steps go over the training pairs at least once)",
        "precompute": f"precompute: the reference log-probs stored by one pass before step 1: no reference model "
                      f"while training (a copy would hold {gb:.3g} GB more)",
    }[mode]


def with_reference(estimate: Any, mode: str) -> Any:
    """The estimate of a DPO step (traced with ROWS_PER_PAIR x the pairs as rows, and with adapter_off or copy the
    reference's no-grad forward in the trace: DpoLogps) plus what the trace does not hold: a copy's weights (the
    policy's own dtype), alive for the whole run."""
    copy_bytes = estimate.weight_bytes if mode == "copy" else 0
    breakdown = dict(estimate.breakdown)
    breakdown["other"] = breakdown.get("other", 0) + copy_bytes  # the tracker's keys: a copy's weights are not trained
    return replace(estimate, peak_bytes=estimate.peak_bytes + copy_bytes, breakdown=breakdown,
                   extra={**estimate.extra, "reference": mode, "reference_bytes": copy_bytes,
                          "reference_why": why(mode, estimate.weight_bytes)})


class DpoLogps:
    """The policy's half of a DPO step as training/objective.py forms it, for the estimator's trace: one forward of
    the rows with the head kept for the last `keep` positions (every position when None, or where the model takes
    no logits_to_keep), then the summed log-probs in fp32 (techniques/logps.py); the loss is their mean (a pair's
    DPO loss is a few scalars on top of them). With `reference` adapter_off or copy the reference's no-grad forward
    of the same rows follows, as the objective runs it (adapter_off: the adapters disabled), in a segment of the
    `tracker`'s own (fref): its logits and log-softmax are alive on top of all the policy's backward will need."""

    name = "plain"  # what the plan shows as memory.loss: the logits are formed, not chunked

    def __init__(self, keep: int | None = None, reference: str | None = None, tracker: Any = None) -> None:
        self.keep, self.tracker = keep, tracker
        self.reference = reference if reference in ("adapter_off", "copy") and tracker is not None else None

    def __call__(self, model: Any, batch: dict[str, Any]) -> Any:
        import contextlib

        import torch

        from memfit.memory.techniques.logps import keeps_logits, sequence_logps

        width = batch["input_ids"].shape[1]
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        keep = self.keep if self.keep is not None and self.keep < width and keeps_logits(model) else None
        kept = {"logits_to_keep": keep} if keep else {}

        def logps() -> tuple[Any, Any]:
            logits = model(**inputs, use_cache=False, **kept).logits
            return sequence_logps(logits, batch["labels"][:, width - logits.shape[1]:])

        summed, counts = logps()
        if self.reference is not None:
            self.tracker.phase("ref", self.tracker.prefix)
            off = model.disable_adapter() if self.reference == "adapter_off" and hasattr(model, "disable_adapter") \
                else contextlib.nullcontext()
            with torch.no_grad(), off:
                reference, _ = logps()
            summed = summed - reference  # the log-ratio the loss takes (a few scalars)
        return -summed.sum() / counts.sum().clamp(min=1)
