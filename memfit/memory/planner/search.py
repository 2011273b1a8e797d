"""From a memfit config to estimates and a plan: target device, budget, candidate stacks, the search."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from memfit.config.devices import DeviceProfile, get_profile, profile_for_report
from memfit.errors import ConfigError
from memfit.memory.estimator.compose import Estimate, Stack
from memfit.memory.estimator.estimate import Estimator
from memfit.memory.estimator.evaluation import plan_evaluation
from memfit.memory.estimator.fake_model import model_config_for, n_blocks_of
from memfit.memory.estimator.tracker import total
from memfit.memory.planner.candidates import (
    adapter_rows,
    configured_stack,
    lean_layer_fallbacks,
    lean_rival,
    lora_fallbacks,
    no_bf16_precision,
    optimizer_fallbacks,
    technique_choices,
    technique_variants,
    techniques,
)
from memfit.memory.planner.plan import (
    MeasuredPeak,
    Plan,
    assignments,
    choose,
    fit_margin,
    measured_reason,
    settled,
)
from memfit.memory.planner.sharding import splits_parameters
from memfit.memory.techniques.policies import make_policy
from memfit.models.experts import keeps_padding_mask, model_param_counts

log = logging.getLogger("memfit.memory")
GB = 1e9


def local_device_report(device: str = "auto") -> dict[str, Any]:
    from memfit.runtime.env import device_report, resolve_device

    return device_report(resolve_device(device))


def target_profile(memory_cfg: Any, device_report: dict[str, Any] | None = None,
                   device_name: str | None = None) -> DeviceProfile:
    """--device, else memory.device, else the device this process runs on, else the CPU profile."""
    if device_name:
        return get_profile(device_name, "--device")
    if memory_cfg.device:
        return get_profile(memory_cfg.device, "memory.device")
    return profile_for_report(device_report or {"type": "cpu"})


def resolve_budget(memory_cfg: Any, profile: DeviceProfile, device_report: dict[str, Any] | None = None,
                   budget_gb: float | None = None, device_named: bool = False) -> tuple[int | None, str]:
    """The bytes the step's tensors may use, and where that figure comes from."""
    if budget_gb is not None:
        return int(budget_gb * GB), "--budget-gb"
    if memory_cfg.budget_gb is not None:
        return int(memory_cfg.budget_gb * GB), "memory.budget_gb"
    if device_named or memory_cfg.device:
        return profile.usable_bytes, f"usable memory of a {profile.name} ({profile.memory_bytes / GB:.1f} GB less " \
                                     f"{profile.reserved_bytes / GB:.1f} GB for the CUDA context)"
    if device_report and device_report.get("type") == "cuda":
        return int(device_report["memory_free_bytes"]), f"free memory of {device_report.get('name')}"
    return None, "none (CPU without memory.budget_gb)"


def explicit_mask(cfg: Any, hf_config: Any) -> bool:
    """Pure: do the run's batches carry an explicit [rows, 1, seq, seq] mask? Yes for padding-free packs, unless the
    model runs flash attention (varlen: no mask); blocks need none; one padded example (or pair) a row runs without
    its mask (right padding: blocks_batch drops it) except on an MoE, whose load-balancing loss reads it. packing
    auto is resolved from the data only when the run prepares it: counted as masked (an upper bound)."""
    if str(getattr(hf_config, "_attn_implementation", None) or "sdpa").startswith("flash"):
        return False
    if cfg.train.objective == "dpo" or cfg.data.packing == "none":
        return keeps_padding_mask(hf_config)
    return cfg.data.packing != "blocks"


def make_estimator(cfg: Any, profile: DeviceProfile, hf_config: Any | None = None) -> Estimator:
    hf_config = hf_config if hf_config is not None else model_config_for(cfg)
    masked = explicit_mask(cfg, hf_config)
    seq_len, keep, covered = cfg.data.seq_len, None, None
    if cfg.train.objective == "dpo":  # a DPO batch is cut to its longest side: the data's longest pair, when known
        from memfit.memory.planner.pair_length import planned_coverage, planned_logits_keep, planned_seq_len

        seq_len, keep, covered = planned_seq_len(cfg), planned_logits_keep(cfg), planned_coverage(cfg)
    return Estimator(hf_config, seq_len, profile,
                     lora_cfg=cfg.lora, save_ops=cfg.memory.selective_save_ops, block_class=cfg.memory.block_class,
                     weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
                     # each rank traces its share of the micro-batch (for_ranks): that is the largest it meets
                     anchor_micro_batch=cfg.train.micro_batch_size // cfg.distributed.world_size,
                     loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
                     dpo=cfg.dpo if cfg.train.objective == "dpo" else None, dpo_logits_keep=keep, dpo_coverage=covered,
                     # strategy auto may shard too (a replica that does not fit): counted as a copy, an upper bound
                     dpo_sharded=cfg.distributed.world_size > 1 and splits_parameters(cfg.distributed.strategy),
                     attention_mask=masked,
                     flattened=masked and cfg.data.packing == "padding_free" and cfg.data.flatten is True)


def policy_kinds(cfg: Any, n_blocks: int, policy: str) -> tuple[str, ...]:
    p = make_policy(policy, every_k=cfg.memory.every_k, save_ops=cfg.memory.selective_save_ops,
                    block_class=cfg.memory.block_class)
    return tuple(p.block_kinds(n_blocks))


def on_ranks(est: Estimator, cfg: Any, limit: float | None) -> Estimator:
    """With several ranks each estimate is one rank's: its share of every micro-batch, and the training state as
    distributed.strategy divides it (auto: ddp where a whole replica fits `limit`, else fsdp2; sharding.py)."""
    world = cfg.distributed.world_size
    if world == 1 or est.world_size == world:
        return est
    from functools import partial

    from memfit.memory.planner.sharding import bucket_elements, rank_share

    copy_set = cfg.train.objective == "dpo" and cfg.dpo.reference == "copy"
    hidden = int(getattr(est.hf_config, "hidden_size", 0) or 0)
    whole = est.for_ranks(world, lambda e: e)  # one rank's rows, its moments kept, nothing divided
    return est.for_ranks(world, partial(rank_share, strategy=cfg.distributed.strategy, world_size=world,
                                        limit=None if limit is None else int(limit),
                                        offload_optimizer=cfg.distributed.offload_optimizer,
                                        reference_copy_set=copy_set, ds_bucket_elements=bucket_elements(hidden),
                                        bf16_model=partial(whole.retraced, precision="bf16-true"),
                                        unit_fractions=est.unit_fractions()))


def estimate_policy(cfg: Any, profile: DeviceProfile, policy: str, hf_config: Any | None = None,
                    estimator: Estimator | None = None, limit: float | None = None) -> Estimate:
    """One estimate: the configured stack under a fixed policy (one rank's with several: `limit` picks auto's
    strategy)."""
    est = on_ranks(estimator or make_estimator(cfg, profile, hf_config), cfg, limit)
    stack = configured_stack(cfg)
    return est.estimate(stack, policy_kinds(cfg, est.n_blocks, policy))


def _micro_batches(cfg: Any) -> list[int]:
    t = cfg.train
    m0 = t.micro_batch_size
    if not cfg.memory.allow_smaller_micro_batch:
        return [m0]
    # Several ranks split every micro-batch evenly: only multiples of the world size (it divides m0).
    world = cfg.distributed.world_size
    divisors = [d for d in range(m0, 0, -1) if t.batch_size % d == 0 and d % world == 0]
    picked = divisors[:4]
    return picked + ([world] if world not in picked else [])


def candidate_tiers(cfg: Any, profile: DeviceProfile) -> list[list[Stack]]:
    """Stacks to try, tier by tier: the configured precision without LoRA first, then LoRA, then a 4-bit
    base, then other precisions, each with the configured optimizer and then the leaner ones
    (optimizer_fallbacks), each without and then with the lean layers (lean_layer_fallbacks); within a tier
    every micro-batch and every technique_choices variant."""
    t = cfg.train
    precisions = [t.precision] + [p for p in cfg.memory.allow_precisions if p != t.precision]
    precisions = [p for p in precisions if profile.bf16 or not p.startswith("bf16")] or [no_bf16_precision(t.precision)]
    choices = technique_choices(cfg, profile)
    tiers = []
    for lora, quantize in lora_fallbacks(cfg.lora):
        for precision in precisions:
            for optimizer in optimizer_fallbacks(cfg, profile):
                for lean in lean_layer_fallbacks(cfg):
                    base = {**techniques(cfg), "optimizer": optimizer, "lean_layers": lean}
                    tiers.append([v for m in _micro_batches(cfg)
                                  for v in technique_variants(Stack(precision, m, t.batch_size // m, lora, quantize,
                                                                    **base), choices)])
    return tiers


def plan_for(cfg: Any, profile: DeviceProfile, budget: int | None, source: str, hf_config: Any | None = None,
             estimator: Estimator | None = None, measured: Sequence[MeasuredPeak] = ()) -> Plan:
    """Estimate the candidate stacks tier by tier and choose; a fixed memory.policy is estimated only (with
    lora.enabled=auto: that policy on each LoRA fallback, until one fits). `measured`: stacks this run was
    stopped at the memory limit with (planner/limits.py); they and what their measurement rules out never fit."""
    t0 = time.perf_counter()
    margin = fit_margin(cfg.memory.safety_margin, profile.kind)
    # Several ranks: every estimate below is one rank's, held to the same limit.
    est = on_ranks(estimator or make_estimator(cfg, profile, hf_config), cfg,
                   None if budget is None else budget * (1.0 - margin))
    n = est.n_blocks
    configured = configured_stack(cfg, lora=cfg.lora.enabled is True)
    if not profile.bf16:
        configured = replace(configured, precision=no_bf16_precision(configured.precision))
    baseline = est.estimate(configured, ("none",) * n)
    policy = cfg.memory.policy
    if policy != "auto":
        if policy == "offload" and profile.kind != "cuda":
            raise ConfigError("memory.policy: 'offload' moves saved activations from the GPU to pinned CPU "
                              f"memory and needs a CUDA device; the target ({profile.name}) has none: "
                              "use 'full' or 'selective'")
        fixed = policy_kinds(cfg, n, policy)
        chosen = est.estimate(configured, fixed)
        limit = None if budget is None else budget * (1.0 - margin)
        if cfg.lora.enabled != "auto" or ((limit is None or chosen.peak_bytes <= limit)
                                          and measured_reason(chosen, measured) is None):
            return choose([chosen], budget, configured=configured, baseline=baseline,
                          safety_margin=margin, budget_source=source, fixed_policy=policy,
                          measured=measured)
        every, fixed_policy = [fixed], policy
    else:
        fixed_policy = None
        limit = None if budget is None else budget * (1.0 - margin)
        if (limit is None or baseline.peak_bytes <= limit) and measured_reason(baseline, measured) is None:
            # No recompute and the configured micro-batch fit: no checkpointing or smaller micro-batch can be
            # faster, but the loss and the step may (plain's logits in one go beat chunked's recomputed head by 1.26x
            # on an H200): those variants without checkpointing compete on time, the fastest that fits wins.
            variants = {est.resolved(v) for v in technique_variants(configured, technique_choices(cfg, profile))}
            rivals = [est.estimate(v, ("none",) * n) for v in sorted(variants - {baseline.stack}, key=repr)]
            return choose([baseline, *rivals], budget, configured=configured, baseline=baseline,
                          safety_margin=margin, budget_source=source, measured=measured)
        kinds = ("none", "selective", "full") + (("offload",) if profile.kind == "cuda" else ())
        every = assignments(n, kinds)
    tiers = candidate_tiers(cfg, profile)
    holds = {(s.precision, s.lora, s.quantize, s.optimizer) for tier in tiers for s in tier}
    if budget is not None and baseline.weight_bytes / est.world_size > budget and len(holds) == 1:
        # The weights alone exceed the budget and no fallback holds them smaller: nothing can fit.
        return choose([baseline], budget, configured=configured, baseline=baseline,
                      safety_margin=margin, budget_source=source, fixed_policy=fixed_policy)
    seen: list[Estimate] = []
    counts: Counter[str] = Counter()  # stacks settled without their checkpointed forms; left without selective
    plan: Plan | None = None
    last: int | None = None  # the index of the last tier to search, once one fits
    for i, tier in enumerate(tiers):
        if last is not None and i > last:
            break
        ordered = sorted(tier, key=lambda s: -s.micro_batch_size)
        if limit is not None:
            # What no activation can lower: weights and optimizer state (gradients too unless stepped in
            # backward), traced once per variant at full depth; a stack over the limit with them is skipped.
            ordered = [s for s in ordered if _floor(est, s) <= limit]
            if not ordered:
                continue  # none of this tier's stacks can fit: not one step traced
        top = ordered[0].micro_batch_size
        firsts = [s for s in ordered if s.micro_batch_size == top]
        counts += _estimate_stacks(est, firsts, every, seen, limit, configured, measured)
        plan = choose(seen, budget, configured=configured, baseline=baseline,
                      safety_margin=margin, budget_source=source,
                      fixed_policy=fixed_policy, measured=measured)
        # Under the step-time model a smaller micro-batch never beats the same policy at a larger one, so
        # they matter only when the largest micro-batch needs recompute (or does not fit at all).
        if plan.fits and plan.chosen is not None and set(plan.chosen.kinds) == {"none"}:
            break
        counts += _estimate_stacks(est, ordered[len(firsts):], every, seen, limit, configured, measured)
        plan = choose(seen, budget, configured=configured, baseline=baseline,
                      safety_margin=margin, budget_source=source,
                      fixed_policy=fixed_policy, measured=measured)
        if plan.fits and last is None:
            # The same stacks with lean layers may fit with fewer blocks recomputed, a faster step despite their
            # few extra ops: where this tier needs recompute, that tier competes on time too, then the search ends.
            last = i + 1 if fixed_policy is None and lean_rival(tier, tiers[i + 1:i + 2]) else i
            if last == i:
                break
    if plan is None:  # every tier's weights exceed the budget: say so for the leanest of them
        plan = choose([baseline], budget, configured=configured, baseline=baseline,
                      safety_margin=margin, budget_source=source,
                      fixed_policy=fixed_policy, measured=measured)
    plan.settled_stacks, plan.no_selective_stacks = counts["settled"], counts["no_selective"]
    log.info("memory planner: %d candidates over %d blocks in %.1f s (traces %.1f s; %d stacks settled without "
             "checkpointing, %d without selective: not even every block full fits)", len(seen), n,
             time.perf_counter() - t0, est.trace_seconds, plan.settled_stacks, plan.no_selective_stacks)
    return plan


def _estimate_stacks(est: Estimator, stacks: Sequence[Stack], every: Sequence[tuple[str, ...]],
                     seen: list[Estimate], limit: float | None, configured: Stack,
                     measured: Sequence[MeasuredPeak]) -> Counter[str]:
    """Estimate `stacks` under every assignment into `seen`, each stack first without checkpointing (its fastest
    form): where that settles it (plan.settled) its checkpointed forms are not traced. The fastest go first, so
    they settle the most. Then the forms without selective; the selective ones only where they may fit
    (selective_may_fit). Returns how many stacks were settled, and how many left without selective."""
    none = ("none",) * est.n_blocks
    if len(every) < 2 or every[0] != none:
        seen += [est.estimate(s, k) for s in stacks for k in every]
        return Counter()
    firsts = sorted((est.estimate(s, none) for s in stacks), key=lambda e: e.step_seconds)
    seen += firsts
    counts: Counter[str] = Counter()
    for first in firsts:
        if settled(first, seen, None if limit is None else int(limit), configured, measured):
            counts["settled"] += 1
            continue
        forms = {k: est.estimate(first.stack, k) for k in every[1:] if "selective" not in k}
        if selective_may_fit(forms.get(("full",) * est.n_blocks), limit):
            forms.update((k, est.estimate(first.stack, k)) for k in every[1:] if "selective" in k)
        else:
            counts["no_selective"] += 1
        seen += [forms[k] for k in every[1:] if k in forms]  # in the assignments' order, as the table lists them
    return counts


def selective_may_fit(all_full: Estimate | None, limit: float | None) -> bool:
    """Pure: whether a stack's selective mixes can fit, given its estimate with every block full (None: not among
    the assignments). A selective block keeps what a full one keeps and more (the outputs it saves) and recomputes
    the rest, so each selective mix peaks at least where the same mix with those blocks full does: when not even
    every block full fits, no selective mix does, and its traces (one a micro-batch traced) are spared."""
    return limit is None or all_full is None or all_full.peak_bytes <= limit


def _floor(est: Estimator, stack: Stack) -> int:
    st = est.static(stack)
    # Several ranks hold at least their 1/world share of it (fsdp2 divides it all): a bound that never skips a fit.
    return total(st.before_opt if not est.resolved(stack).optimizer_in_backward else st.after_opt) // est.world_size


def n_blocks_for(cfg: Any, hf_config: Any | None = None) -> int:
    return n_blocks_of(hf_config if hf_config is not None else model_config_for(cfg))


# -- what `memfit estimate` and `memfit plan` print -----------------------------------------------------------
def resolve_target(cfg: Any, device: str | None, budget_gb: float | None) -> tuple[DeviceProfile, int | None, str]:
    report = None if (device or cfg.memory.device) else local_device_report(cfg.train.device)
    profile = target_profile(cfg.memory, report, device)
    budget, source = resolve_budget(cfg.memory, profile, report, budget_gb, device_named=bool(device))
    return profile, budget, source


def estimate_report(cfg: Any, device: str | None = None, budget_gb: float | None = None,
                    policy: str | None = None) -> dict[str, Any]:
    """The predicted peak of one training step for the config (memory.policy, or --policy), on a target."""
    t0 = time.perf_counter()
    if policy is not None:
        cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"policy": policy})})
    profile, budget, source = resolve_target(cfg, device, budget_gb)
    est = make_estimator(cfg, profile)
    limit = None if budget is None else int(budget * (1 - fit_margin(cfg.memory.safety_margin, profile.kind)))
    if cfg.memory.policy == "auto":
        plan = plan_for(cfg, profile, budget, source, estimator=est)
        e = plan.chosen or min(plan.table, key=lambda x: x.peak_bytes)
    else:
        e = estimate_policy(cfg, profile, cfg.memory.policy, estimator=est, limit=limit)
    counts = model_param_counts(est.hf_config, est.base_model())  # the meta build the estimator holds
    return {
        "params_total": counts["total"], "params_active": counts["active"],
        "experts": None if counts["experts"] is None else dict(zip(("routed", "per_token"), counts["experts"],
                                                                   strict=True)),
        "adapter_rows": adapter_rows(cfg, est, e, limit),
        "total_bytes": e.peak_bytes, "breakdown": dict(e.breakdown), "activation_bytes": e.activation_bytes,
        "peak_at": e.peak_at, "policy": e.policy, "every_k": e.every_k,
        "blocks": {k: sum(1 for x in e.kinds if x == k) for k in sorted(set(e.kinds))},
        "precision": e.stack.precision, "micro_batch_size": e.stack.micro_batch_size,
        "grad_accum_steps": e.stack.grad_accum_steps, "seq_len": est.seq_len, "lora": e.stack.lora,
        "quantize": e.stack.quantize, "dpo": dpo_report(cfg, est, e),
        "ranks": None if "ranks" not in e.extra else {k: e.extra["ranks"][k]
                                                      for k in ("strategy", "world_size", "why")},
        "n_params": e.n_params, "n_trainable": e.n_trainable, "weight_bytes": e.weight_bytes,
        "host_bytes": e.host_bytes, "predicted_step_seconds": round(e.step_seconds, 6),
        "device": profile.name, "device_memory_bytes": profile.memory_bytes,
        "device_usable_bytes": profile.usable_bytes, "budget_bytes": budget, "budget_source": source,
        "fits": None if limit is None else e.peak_bytes <= limit, "method": e.method,
        "elapsed_seconds": round(time.perf_counter() - t0, 2),
    }


def dpo_report(cfg: Any, est: Estimator, e: Estimate) -> dict[str, Any] | None:
    """What a DPO estimate planned (None for sft): its rows (the data's longest pair, or data.seq_len unread), the
    head's kept positions, the passes over the pairs and the reference mode they resolve, and why."""
    if est.dpo is None:
        return None
    from memfit.memory.planner.pair_length import pair_lengths

    pairs = e.stack.micro_batch_size
    return {"pairs_read": pair_lengths(cfg) is not None, "pairs": pairs, "rows": pairs * est.rows_per_example,
            "row_tokens": est.seq_len, "data_seq_len": cfg.data.seq_len, "logits_keep": est.dpo_logits_keep,
            "coverage": est.dpo_coverage, "reference": e.extra.get("reference"),
            "reference_bytes": e.extra.get("reference_bytes"), "reference_why": e.extra.get("reference_why")}


def plan_report(cfg: Any, device: str | None = None, budget_gb: float | None = None,
                measured: Sequence[MeasuredPeak] = ()) -> tuple[Plan, dict[str, Any]]:
    profile, budget, source = resolve_target(cfg, device, budget_gb)
    plan = plan_for(cfg, profile, budget, source, measured=measured)
    out = plan.to_dict()
    out["device"] = profile.name
    if plan.table:
        out["evaluation"] = plan_evaluation(model_config_for(cfg), plan.table[0].n_params, cfg, plan.limit_bytes,
                                            profile.name, profile.kind, profile.bf16)
    return plan, out


def per_gpu_report(plan: Plan, world: int) -> dict[str, Any]:
    """`memfit plan` with several ranks: the plan is already one rank's (its share of every micro-batch, the state
    as the strategy divides it: on_ranks); this is its chosen stack under every strategy (planner/sharding.py)."""
    if plan.chosen is None:
        return {"world_size": world, "error": plan.error}
    ranks = plan.chosen.extra["ranks"]
    chosen = ranks["rows"][ranks["strategy"]]
    return {"world_size": world, "strategy": ranks["strategy"], "reason": ranks["why"],
            "per_gpu_bytes": chosen["total"], "fits": plan.budget_bytes is None or chosen["total"] <= plan.budget_bytes,
            "budget_bytes": plan.budget_bytes, "per_rank_plan": plan.row(plan.chosen), "strategies": ranks["rows"]}
