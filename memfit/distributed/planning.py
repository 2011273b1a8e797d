"""Phase 2 for several ranks: which strategy divides the training state, and what each rank then needs."""

from __future__ import annotations

import logging
from typing import Any

from memfit.config import MemfitConfig
from memfit.errors import ConfigError
from memfit.memory.planner.sharding import (
    choose_strategy,
    human,
    per_rank_bytes,
    splits_parameters,
    training_state_bytes,
)
from memfit.reports import PlanReport, ProbeReport

log = logging.getLogger("memfit.distributed")


def state_bytes_from_probe(cfg: MemfitConfig, probe: ProbeReport, plan: PlanReport) -> dict[str, int]:
    """params / grads / optim from the parameter counts as planned (LoRA trains its adapters only; a plan saved
    before they were recorded counts every parameter as trained); activations as measured for one rank's
    micro-batch (a DPO probe ran its chosen and rejected rows: phase 1)."""
    trained = plan.trainable_params if plan.trainable_params is not None else probe.n_params
    parts = training_state_bytes(trained, plan.precision)
    if plan.weight_bytes is not None:
        parts["params"] = plan.weight_bytes  # the frozen base too (at 4 bits when quantized)
    b = probe.baseline
    breakdown = b.get("breakdown") or {}
    if breakdown:  # CPU MemTracker: activations and temporaries measured separately
        acts = int(breakdown.get("activation", 0)) + int(breakdown.get("temp", 0))
    else:  # CUDA: the measured peak minus the analytic state of the probe's full fine-tuning (never below zero)
        probed = training_state_bytes(probe.n_params, plan.precision)
        acts = max(0, int(b.get("peak_bytes") or 0) - sum(probed.values()))
    block = parts["params"] // cfg.model.num_layers if not cfg.model.name_or_path else 0
    return {**parts, "activations": acts, "block_bytes": block}


def reference_copy(cfg: MemfitConfig, plan: PlanReport, weight_bytes: int) -> int:
    """DPO's frozen reference copy on a rank that holds a whole replica: the model's weights once more when
    dpo.reference resolves to copy there (estimator/preference.py's rule, as the ranks apply it), else 0."""
    if cfg.train.objective != "dpo":
        return 0
    from memfit.memory.estimator.preference import reference_mode
    from memfit.memory.planner.pair_length import planned_coverage

    mode = reference_mode(cfg.dpo.reference, cfg.dpo.loss_type, plan.lora, planned_coverage(cfg), sharded=False)
    return weight_bytes if mode == "copy" else 0


def plan_distributed(cfg: MemfitConfig, probe: ProbeReport, plan: PlanReport) -> PlanReport:
    """The plan with `strategy`, `world_size` and per-rank bytes (`sharding`); one process: strategy single."""
    world = cfg.distributed.world_size
    if world == 1:
        return plan.model_copy(update={"strategy": "single", "world_size": 1})
    from memfit.distributed.strategies import DEEPSPEED_STRATEGIES, check_strategy

    budget = probe.baseline.get("budget_bytes")
    requested = cfg.distributed.strategy
    if plan.ranks is not None:  # the planner held one rank's step to the limit under this strategy
        strategy, why, est = plan.ranks["strategy"], plan.ranks["why"], plan.ranks["rows"][plan.ranks["strategy"]]
    elif requested == "auto":
        s = state_bytes_from_probe(cfg, probe, plan)
        ref = reference_copy(cfg, plan, s["params"])
        copy_set = cfg.train.objective == "dpo" and cfg.dpo.reference == "copy"
        strategy, why, est = choose_strategy(s["params"], s["grads"], s["optim"], s["activations"], world, budget,
                                             block_bytes=s["block_bytes"], reference_bytes=ref,
                                             reference_copy_set=copy_set, trained_bytes=s["grads"])
    else:
        s = state_bytes_from_probe(cfg, probe, plan)
        ref = reference_copy(cfg, plan, s["params"])
        strategy = requested
        est = per_rank_bytes(s["params"], s["grads"], s["optim"], s["activations"], strategy, world,
                             block_bytes=s["block_bytes"], offload_optimizer=cfg.distributed.offload_optimizer,
                             reference_bytes=ref, trained_bytes=s["grads"])
        why = f"distributed.strategy={strategy} set in the config ({human(est['total'])} per rank estimated)"
    check_strategy(strategy, plan.precision)
    if strategy in DEEPSPEED_STRATEGIES:
        from memfit.distributed.ds_config import import_deepspeed

        import_deepspeed()  # missing DeepSpeed fails here, in phase 2, not after the ranks started
    if splits_parameters(strategy) and plan.policy == "offload":
        raise ConfigError(f"memory.policy=offload with distributed.strategy={strategy}: use full or selective "
                          "(sharding already frees the memory offload would)")
    log.info("distributed: %s on %d ranks: %s", strategy, world, why)
    if requested != "auto" and budget is not None and est["total"] > budget:
        log.warning("distributed: %s is estimated at %s per rank, over the %s budget (distributed.strategy auto "
                    "would say what fits)", strategy, human(est["total"]), human(budget))
    # Several ranks run the model's own loss: an auto loss is plain there (chunked is refused when built).
    loss = "plain" if cfg.memory.loss == "auto" else cfg.memory.loss
    return plan.model_copy(update={"strategy": strategy, "world_size": world, "sharding": _jsonable(est),
                                   "reason": f"{plan.reason}; {why}", "loss": loss})


def _jsonable(est: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in est.items()}
