"""How parameters, gradients and optimizer state divide across ranks per strategy: pure byte arithmetic."""

# The estimator (or the baseline probe) says what ONE process needs; `per_rank_bytes` says what each rank
# needs under a data-parallel strategy, and `choose_strategy` picks the cheapest strategy that fits a
# per-device budget. Nothing here touches torch or a device, so `memfit plan` can answer for 8 GPUs on a
# laptop. Rules (data parallel throughout; the model is never split by layer or by tensor):
#
# | strategy        | params | grads | optimizer state | transient per rank                          |
# |-----------------|--------|-------|-----------------|---------------------------------------------|
# | single          | full   | full  | full            | none                                        |
# | ddp             | full   | full  | full            | the gradients' size (buckets rebuilt once)  |
# | deepspeed_zero2 | full   | / N   | / N (+ fp32 copy)| two reduce buckets; in backward, a second  |
# |                 |        |       |                 | gradient partition                          |
# | fsdp2           | / N    | / N   | / N             | all-gathered block params (this one, the    |
# | deepspeed_zero3 | / N    | / N   | / N             | prefetched next) + that block's full grads  |
#                                                          (+ ZeRO-3's reduce bucket)
#
# DDP's gradients are views into its buckets (gradient_as_bucket_view), but after the first step DDP rebuilds the
# buckets in the order the gradients came, the first ones still allocated: measured on two CPU ranks, a rank's live
# tensor peak was one gradient's size above one process's at its second step (6.25 / 8.42 / 7.70 / 7.70 MB in steps 1-4,
# the process's own figure 7.69), so the peak a plan must hold counts it. FSDP2 keeps the last block gathered after
# forward (distributed/strategies.py), a third block's parameters, and stages its collectives in flat buffers of a block
# each (torch's _fsdp_collectives): the all-gather's output beside the parameters it is copied out to, and the reduce-
# scatter's input, which holds one block's gradients until the next block's is issued, beside the block's unsharded
# gradients. DeepSpeed's buckets are hidden_size^2 elements as memfit configures them (distributed/ds_config.py; at its
# default of 5e8 elements a ZeRO-2 rank of the tiny model held 4.0 GB): ZeRO-2 reduces into two (overlap_comm) and keeps
# an fp32 copy of its partition of the weights for the optimizer (even when they are fp32 already); ZeRO-3 one bucket.
# ZeRO-2 allocates its gradient partition anew, whole, at the first reduce of every micro-batch's backward while the
# partition accumulated from the earlier ones lives on (stage_1_and_2's grads_in_partition and all_grad_tensors; at
# the last micro-batch the flat copy the optimizer steps on takes its place): measured, a timeline of a checkpointed
# rank's tensors at its peak held two 361 KB partitions of the tiny model's gradients.
#
# `offload_optimizer` (DeepSpeed only) moves the optimizer state to CPU memory: it leaves the device total
# and is reported as `cpu_offload`. Activations are never divided: each rank holds the activations of its
# own micro-batch, which is the global micro-batch / world size (`activations` is that per-rank figure).
#
# DPO's frozen reference copy (`reference_bytes`: the model's weights once more) sits whole on every rank that
# holds a whole replica (ddp, deepspeed_zero2: a copy of the module is never sharded). Where each rank holds a
# slice (fsdp2, deepspeed_zero3) nothing is copied: the reference log-probs are precomputed before step 1, so
# the copy costs those ranks nothing while training.

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

GB = 1e9
STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")


@dataclass(frozen=True)
class ShardingRule:
    """Which parts of the training state a strategy divides by the world size."""

    params: bool
    grads: bool
    optim: bool
    gathers_blocks: bool  # parameters are all-gathered one block at a time (fully sharded)
    kept_blocks: int = 0  # blocks left gathered after forward (memfit's FSDP2: the last one, backward's first)
    staged: bool = False  # FSDP2's flat all-gather output and reduce-scatter input, a block each
    buckets: bool = False  # DDP's gradient-sized buckets, rebuilt once beside the first ones
    ds_buckets: int = 0  # DeepSpeed's reduce buckets (ds_bucket_bytes each)
    master_partition: bool = False  # ZeRO-2's fp32 copy of this rank's partition of the trained weights
    # ZeRO-2 allocates its gradient partition whole at each backward's first reduce, beside the partition
    # accumulated from the earlier micro-batches (or, at the last, the flat copy the optimizer steps on)
    fresh_grad_partition: bool = False


RULES: dict[str, ShardingRule] = {
    "single": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False),
    "ddp": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False, buckets=True),
    "deepspeed_zero2": ShardingRule(params=False, grads=True, optim=True, gathers_blocks=False, ds_buckets=2,
                                    master_partition=True, fresh_grad_partition=True),
    "fsdp2": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True, kept_blocks=1, staged=True),
    "deepspeed_zero3": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True, ds_buckets=1),
}


def splits_parameters(strategy: str) -> bool:
    """Pure: whether each rank holds only a slice of the weights (fsdp2, deepspeed_zero3): no whole copy of the
    model exists on any rank. False for auto, which is resolved later."""
    rule = RULES.get(strategy)
    return rule is not None and rule.params


def human(nbytes: float) -> str:
    """Bytes as GB (1e9), or MB / kB for small figures (tiny test models), for reasons and tables."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size / 10 or unit == "kB":
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"  # pragma: no cover - unreachable


def bucket_elements(hidden_size: int) -> int:
    """Pure: DeepSpeed's communication buckets for a model of this width (elements): hidden_size squared, as
    transformers' DeepSpeed integration sizes them ("auto"). DeepSpeed's own default is 5e8 elements whatever the
    model: measured on two CPU ranks of the tiny model, 4.0 GB a rank under ZeRO-2 (two such buffers with
    overlap_comm) and 2.0 GB under ZeRO-3, for a model of 0.7 MB."""
    return int(hidden_size) ** 2


def _shard(nbytes: int, divide: bool, world_size: int) -> int:
    # Each rank holds ceil(n / N): shards are padded to equal size (FSDP2 pads dim 0, ZeRO pads flat buffers).
    return math.ceil(nbytes / world_size) if divide else int(nbytes)


def per_rank_bytes(params: int, grads: int, optim: int, activations: int, strategy: str, world_size: int, *,
                   block_bytes: int = 0, offload_optimizer: bool = False, reference_bytes: int = 0,
                   trained_bytes: int = 0, block_grad_bytes: int | None = None,
                   gathered_block_bytes: int | None = None, ds_bucket_bytes: int = 0,
                   master_bytes: int | None = None) -> dict[str, Any]:
    """Bytes ONE rank needs for the training state under `strategy` on `world_size` ranks.

    params / grads / optim: what a single process holds for the whole model (e.g. fp32 AdamW: 4, 4 and
    8 bytes per trainable parameter; include fp32 master weights in `optim` when the strategy keeps them).
    activations: the peak activation bytes of one rank's micro-batch. block_bytes: parameter bytes of the
    largest decoder block (fully sharded strategies all-gather two at a time and hold one block's full
    gradients before the reduce-scatter; 0 leaves this transient out). reference_bytes: a DPO reference copy's
    weights, held whole where the strategy keeps a whole replica and not at all where it splits the
    parameters (precomputed there). trained_bytes: the trained parameters at their gradients' width (DDP's
    buckets; ZeRO-2's fp32 copy of a partition). ds_bucket_bytes: one of DeepSpeed's reduce buckets.
    block_grad_bytes: one block's gradients (default: block_bytes scaled as `grads` is to `params`).
    gathered_block_bytes: one block's weights as gathered (default block_bytes; FSDP2 with bf16-mixed gathers them
    in bf16). master_bytes: the fp32 master copy of the trained weights ZeRO-2 partitions (default trained_bytes;
    twice them where DeepSpeed trains a bf16 model). Returns
    the parts, their `total` on the device, `cpu_offload` bytes, and which parts are `sharded`.
    """
    if strategy not in RULES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    if strategy == "single" and world_size != 1:
        raise ValueError("strategy 'single' means one process: world_size must be 1")
    if offload_optimizer and not strategy.startswith("deepspeed"):
        raise ValueError(f"offload_optimizer is a DeepSpeed (ZeRO-Offload) feature, not available with {strategy}")
    for name, value in (("params", params), ("grads", grads), ("optim", optim), ("activations", activations),
                        ("block_bytes", block_bytes), ("reference_bytes", reference_bytes),
                        ("trained_bytes", trained_bytes), ("ds_bucket_bytes", ds_bucket_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes (got {value})")
    rule = RULES[strategy]
    out_params = _shard(params, rule.params, world_size)
    out_grads = _shard(grads, rule.grads, world_size)
    out_optim = _shard(optim, rule.optim, world_size)
    cpu = 0
    if offload_optimizer:
        cpu, out_optim = out_optim, 0
    transient = 0
    if rule.gathers_blocks and world_size > 1 and block_bytes:
        # Two unsharded blocks (the one computing, the next prefetched), any kept gathered after forward, and the
        # full grads of one block; FSDP2's staging buffers, one more block of each.
        blocks = 2 + rule.kept_blocks + rule.staged
        if block_grad_bytes is None:
            block_grad_bytes = int(block_bytes * (grads / params if params else 1.0))
        gathered = block_bytes if gathered_block_bytes is None else gathered_block_bytes
        transient = blocks * int(gathered) + (1 + rule.staged) * int(block_grad_bytes)
    if rule.buckets and world_size > 1:
        transient += int(trained_bytes)
    transient += rule.ds_buckets * int(ds_bucket_bytes)
    master = trained_bytes if master_bytes is None else master_bytes
    if rule.master_partition and not offload_optimizer:
        out_optim += _shard(master, True, world_size)
    elif rule.master_partition:
        cpu += _shard(master, True, world_size)
    reference = 0 if rule.params else int(reference_bytes)
    total = out_params + out_grads + out_optim + int(activations) + transient + reference
    return {
        "strategy": strategy, "world_size": world_size, "params": out_params, "grads": out_grads,
        "optim": out_optim, "activations": int(activations), "transient": transient, "reference": reference,
        "total": total,
        "cpu_offload": cpu,
        "sharded": {"params": rule.params, "grads": rule.grads, "optim": rule.optim},
    }


def training_state_bytes(n_trainable: int, precision: str, n_frozen: int = 0) -> dict[str, int]:
    """params / grads / optim bytes of AdamW training for one process, by train.precision.

    fp32 and *-mixed keep fp32 weights (autocast computes in low precision): 4 + 4 + 8 bytes per trainable
    parameter. bf16-true keeps everything in bf16: 2 + 2 + 4. Frozen parameters (LoRA's base) only cost
    their weights.
    """
    width = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16-true": 2}.get(precision)
    if width is None:
        raise ValueError(f"unknown precision {precision!r}")
    return {"params": (n_trainable + n_frozen) * width, "grads": n_trainable * width,
            "optim": 2 * n_trainable * width}


def choose_strategy(params: int, grads: int, optim: int, activations: int, world_size: int,
                    budget_bytes: int | None, *, block_bytes: int = 0, reference_bytes: int = 0,
                    reference_copy_set: bool = False, trained_bytes: int = 0) -> tuple[str, str, dict[str, Any]]:
    """`distributed.strategy=auto`: (strategy, why, its per-rank bytes).

    ddp when a full replica fits the budget (fastest: one all-reduce, no gathers); otherwise fsdp2
    (parameters, gradients and optimizer state sharded). fsdp2 is also the answer when nothing fits; the
    reason says so and names the ways out (more ranks, gradient checkpointing, DeepSpeed offload).
    reference_bytes: DPO's frozen reference copy, which a replica holds whole and fsdp2 replaces by precomputed
    log-probs; `reference_copy_set` (dpo.reference: copy in the config) keeps the copy, so fsdp2 is out.
    """
    if world_size == 1:
        est = per_rank_bytes(params, grads, optim, activations, "single", 1, reference_bytes=reference_bytes)
        return "single", "one process: nothing to divide", est
    ddp = per_rank_bytes(params, grads, optim, activations, "ddp", world_size, reference_bytes=reference_bytes,
                         trained_bytes=trained_bytes)
    fsdp = per_rank_bytes(params, grads, optim, activations, "fsdp2", world_size, block_bytes=block_bytes,
                          reference_bytes=reference_bytes)
    return strategy_between(ddp, fsdp, budget_bytes, reference_bytes, reference_copy_set)


def strategy_between(ddp: dict[str, Any], fsdp: dict[str, Any], budget_bytes: int | None, reference_bytes: int = 0,
                     reference_copy_set: bool = False) -> tuple[str, str, dict[str, Any]]:
    """choose_strategy's rule on a rank's bytes under ddp and under fsdp2 (per_rank_bytes rows)."""
    world_size = ddp["world_size"]
    copy = f" (with the DPO reference copy's {human(reference_bytes)})" if reference_bytes else ""
    if budget_bytes is None:
        return "ddp", "no memory budget known: replicate the model (ddp, fastest)", ddp
    if ddp["total"] <= budget_bytes:
        return "ddp", (f"a full replica{copy} needs {human(ddp['total'])} per rank, within the "
                       f"{human(budget_bytes)} budget: ddp"), ddp
    if reference_copy_set:
        return "ddp", (f"a full replica{copy} needs {human(ddp['total'])} per rank, over the "
                       f"{human(budget_bytes)} budget, and dpo.reference: copy keeps a whole copy, which fsdp2 "
                       "cannot shard: set dpo.reference to precompute (or auto) so fsdp2 can shard the model, "
                       "or distributed.strategy: deepspeed_zero2"), ddp
    precomputed = "; the reference log-probs are precomputed (a sharded model is not copied)" if copy else ""
    if fsdp["total"] <= budget_bytes:
        return "fsdp2", (f"a full replica{copy} needs {human(ddp['total'])} per rank, over the "
                         f"{human(budget_bytes)} budget; sharded over {world_size} ranks it needs "
                         f"{human(fsdp['total'])}{precomputed}: fsdp2"), fsdp
    return "fsdp2", (f"even sharded over {world_size} ranks the step needs {human(fsdp['total'])} per rank, "
                     f"over the {human(budget_bytes)} budget: add ranks, use gradient checkpointing, or "
                     "deepspeed_zero3 with distributed.offload_optimizer=true"), fsdp


def rank_parts(breakdown: Mapping[str, int], phase: str) -> tuple[int, int, int, int]:
    """Pure: one moment of one process's step (the estimator's bytes by category, no DPO reference copy in it) as
    per_rank_bytes' params, grads, optim and activations. `other` is what the moment holds besides: at the optimizer
    step (`phase` step) gradient-sized scratch (AdamW's foreach copies), which shards with the gradients; in the
    forward and backward the loss's temporaries, activation gradients and a checkpointed block's recomputed
    activations, which no strategy divides (counted as gradients, a ZeRO-2 rank with every block checkpointed held
    11 % more than planned: docs/distributed.md)."""
    other, at_step = int(breakdown.get("other", 0)), phase == "step"
    grads = int(breakdown.get("grads", 0)) + (other if at_step else 0)
    acts = int(breakdown.get("activations", 0)) + (0 if at_step else other)
    return int(breakdown.get("params", 0)), grads, int(breakdown.get("optimizer", 0)), acts


def rank_peak(moments: list[tuple[str, Mapping[str, int]]], strategy: str, world_size: int, n_blocks: int,
              trained: int, reference_bytes: int = 0, offload_optimizer: bool = False, precision: str = "fp32",
              ds_bucket_bytes: int = 0, master: int | None = None) -> dict[str, Any]:
    """Pure: one rank's per_rank_bytes row at the moment of the step where it peaks. Sharding shrinks the state,
    not the activations, so that moment need not be where one process peaks (`moments`: every moment's phase and
    bytes by category, none of them holding the reference copy). In the backward only, a fully sharded rank holds
    a block's unsharded gradients and a ZeRO-2 rank a second whole gradient partition. `trained`: every gradient's
    bytes (DDP's buckets, ZeRO-2's partitions). FSDP2 gathers bf16-mixed weights in bf16 (distributed/strategies.py's
    MixedPrecisionPolicy)."""
    n = max(1, n_blocks)
    half = strategy == "fsdp2" and precision == "bf16-mixed"
    fresh = RULES[strategy].fresh_grad_partition

    def row(phase: str, params: int, grads: int, optim: int, acts: int) -> dict[str, Any]:
        backward = phase == "backward"
        return per_rank_bytes(params, grads + (trained if fresh and backward else 0), optim, acts, strategy,
                              world_size, block_bytes=params // n, reference_bytes=reference_bytes,
                              offload_optimizer=offload_optimizer, trained_bytes=trained,
                              block_grad_bytes=trained // n if backward else 0,
                              gathered_block_bytes=params // n // 2 if half else None, ds_bucket_bytes=ds_bucket_bytes,
                              master_bytes=master)

    rows = (row(phase, *parts) for phase, parts in {(p, rank_parts(v, p)) for p, v in moments})  # alike: once
    return max(rows, key=lambda r: r["total"])


def rank_share(estimate: Any, *, strategy: str, world_size: int, limit: int | None, offload_optimizer: bool = False,
               reference_copy_set: bool = False, ds_bucket_elements: int = 0,
               bf16_model: Callable[[Any], Any] | None = None) -> Any:
    """One process's estimate (traced at one rank's rows, with its moments) as one rank's under `strategy` (auto:
    ddp or fsdp2 by choose_strategy's rule against `limit`, the budget less its margin): the peak and breakdown
    become the rank's; the strategy, why, and every strategy's row are kept in extra["ranks"] (for `memfit plan`
    and phase 2). bf16_model: the same step traced in bf16-true (moments kept), for DeepSpeed under bf16-mixed."""
    ref = int(estimate.extra.get("reference_bytes") or 0)
    n_blocks = len(estimate.kinds)
    plain = _rank_basis(estimate, ds_bucket_elements)  # compose keeps the moments when the estimator has a share
    deepspeed = _deepspeed_in_bf16(estimate, bf16_model, ds_bucket_elements)

    def peak(s: str, offload: bool = False) -> dict[str, Any]:
        b = deepspeed if deepspeed is not None and s.startswith("deepspeed") else plain
        return rank_peak(b.moments, s, world_size, n_blocks, b.trained, ref, offload, b.precision, b.bucket, b.master)

    rows = {s: peak(s) for s in STRATEGIES if s != "single"}
    if strategy == "auto":
        strategy, why, row = strategy_between(rows["ddp"], rows["fsdp2"], limit, ref, reference_copy_set)
    else:
        row = peak(strategy, offload=True) if offload_optimizer else rows[strategy]
        why = f"distributed.strategy={strategy} set in the config ({human(row['total'])} per rank estimated)"
    rows[strategy] = row
    breakdown = {"params": row["params"], "grads": row["grads"], "optimizer": row["optim"],
                 "activations": row["activations"], "other": row["transient"] + row["reference"]}
    if not any(row["sharded"].values()):  # ddp: one process's step at a rank's rows, as traced, and the buckets
        breakdown = dict(estimate.breakdown, other=estimate.breakdown["other"] + row["transient"])
    ranks = {"strategy": strategy, "why": why, "world_size": world_size, "reference_bytes": ref,
             "limit_bytes": limit, "rows": rows}
    return replace(estimate, peak_bytes=row["total"], breakdown=breakdown, moments=[],
                   host_bytes=estimate.host_bytes + row["cpu_offload"], extra={**estimate.extra, "ranks": ranks})


@dataclass(frozen=True)
class RankBasis:
    """What a rank's rows are counted from: the step's moments, every gradient's bytes (`trained`), one DeepSpeed
    reduce bucket, the precision the moments were traced in, and the fp32 master copy ZeRO-2 partitions (None:
    `trained`)."""

    moments: list[tuple[str, Mapping[str, int]]]
    trained: int
    bucket: int
    precision: str
    master: int | None = None


def _rank_basis(estimate: Any, ds_bucket_elements: int) -> RankBasis:
    trained = max(int(v.get("grads", 0)) for _, v in estimate.moments)  # every gradient, as at the optimizer step
    # DeepSpeed's reduce buckets hold gradients: ds_bucket_elements at the gradients' width
    bucket = ds_bucket_elements * trained // max(1, estimate.n_trainable)
    return RankBasis(estimate.moments, trained, bucket, estimate.stack.precision)


def _deepspeed_in_bf16(estimate: Any, bf16_model: Callable[[Any], Any] | None,
                       ds_bucket_elements: int) -> RankBasis | None:
    """Under bf16-mixed DeepSpeed holds the model itself in bf16 (its `bf16` section converts the module), not fp32
    weights under autocast: bf16 weights and gradients, an fp32 master copy of the trained weights and fp32 AdamW
    moments (its own AdamW, 8 B a trained parameter, whatever memory.optimizer says). So its rows come from the
    step traced in bf16-true, the optimizer state made fp32. Counted from the bf16-mixed trace, ZeRO-2 and ZeRO-3
    ranks of the tiny model read 1.34x what they held (docs/distributed.md). None where that does not apply."""
    if bf16_model is None or estimate.stack.precision != "bf16-mixed":
        return None
    traced = _rank_basis(bf16_model(estimate), ds_bucket_elements)  # bf16 gradients: 2 B a trained parameter
    moments = [(phase, {**v, "optimizer": 4 * traced.trained}) for phase, v in traced.moments]  # fp32 m and v: 8 B
    return replace(traced, moments=moments, master=2 * traced.trained)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of per_rank_bytes results (GB), one row per strategy: for `memfit plan`."""
    head = f"{'strategy':<16}{'ranks':>6}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'transient':>10}" \
           f"{'ref.':>8}{'total/rank':>12}{'cpu':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['strategy']:<16}{r['world_size']:>6}" + "".join(
            f"{r[k] / GB:>9.2f}" for k in ("params", "grads", "optim", "activations"))
            + f"{r['transient'] / GB:>10.2f}{r.get('reference', 0) / GB:>8.2f}{r['total'] / GB:>12.2f}"
            + f"{r['cpu_offload'] / GB:>8.2f}")
    return "\n".join(lines)


def per_gpu_text(d: dict[str, Any]) -> str:
    """`memfit plan` with several ranks: the strategy chosen and every strategy's share per GPU."""
    return (f"\nper GPU on {d['world_size']} ranks: {d['strategy']} ({d['reason']})\n"
            + format_table(list(d["strategies"].values())))
