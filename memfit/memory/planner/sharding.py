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
# | fsdp2           | / N    | / N   | / N             | the root unit and three blocks gathered;    |
# |                 |        |       |                 | in backward their unsharded gradients       |
# | deepspeed_zero3 | / N    | / N   | / N (+ fp32 copy)| weights up to its live limit, a block's    |
# |                 |        |       |                 | gradients, a reduce bucket                  |
#
# Measured on two CPU ranks (bench/rank_memory.py: rank 0's live tensors at its peak, a DTensor counted by its local
# shard). DDP's gradients are views into its buckets (gradient_as_bucket_view), but after the first step DDP rebuilds
# the buckets in the order the gradients came, the first ones still allocated: a rank's peak was one gradient's size
# above one process's at its second step, so the plan counts it. FSDP2 (distributed/strategies.py) shards each block
# and then the root module, whose unit (embeddings, final norm, head: for Llama-3-8B 1.05 B parameters, five blocks'
# worth) stays gathered from the forward's start to the backward's end, as fully_shard does for a root; of the
# blocks, the one computing, the next prefetched and the last (kept after forward). In the backward a unit's
# gradients are unsharded until its reduce-scatter (the root's until the end), beside the reduce-scatter's input;
# the loss's own backward comes first, before any parameter has a gradient, and is where a rank without gradient
# checkpointing peaks. Under bf16-mixed FSDP2 computes in bf16 throughout (MixedPrecisionPolicy), the residual
# stream too: its activations are the bf16-true trace's, its sharded state fp32. DeepSpeed's buckets are
# hidden_size^2 elements as memfit configures them (distributed/ds_config.py; at its default of 5e8 elements a ZeRO-2
# rank of the tiny model held 4.0 GB): ZeRO-2 reduces into two (overlap_comm), ZeRO-3 into one; both keep an fp32
# copy of their partition of the weights for the optimizer, even when the weights are fp32 already. ZeRO-2 allocates
# its gradient partition anew, whole, at the first reduce of every micro-batch's backward while the partition
# accumulated from the earlier ones lives on (stage_1_and_2's grads_in_partition and all_grad_tensors; at the last
# micro-batch the flat copy the optimizer steps on takes its place).
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
ZERO3_MAX_LIVE = 10**9  # DeepSpeed's stage3_max_live_parameters default (elements)
STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")


@dataclass(frozen=True)
class ShardingRule:
    """Which parts of the training state a strategy divides by the world size."""

    params: bool
    grads: bool
    optim: bool
    gathers_blocks: bool  # parameters are all-gathered one block at a time (fully sharded)
    gathered_blocks: int = 2  # blocks gathered at once (FSDP2: computing, prefetched, the last kept after forward)
    live_limited: bool = False  # ZeRO-3: fetched weights stay gathered up to stage3_max_live_parameters
    keeps_root: bool = False  # FSDP2's root unit (embeddings, final norm, head) stays gathered the whole step
    staged: bool = False  # FSDP2's reduce-scatter input: a block's gradients once more, in the reduce dtype
    buckets: bool = False  # DDP's gradient-sized buckets, rebuilt once beside the first ones
    ds_buckets: int = 0  # DeepSpeed's reduce buckets (ds_bucket_bytes each)
    master_partition: bool = False  # ZeRO's fp32 copy of this rank's partition of the trained weights
    # ZeRO-2 allocates its gradient partition whole at each backward's first reduce, beside the partition
    # accumulated from the earlier micro-batches (or, at the last, the flat copy the optimizer steps on)
    fresh_grad_partition: bool = False


RULES: dict[str, ShardingRule] = {
    "single": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False),
    "ddp": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False, buckets=True),
    "deepspeed_zero2": ShardingRule(params=False, grads=True, optim=True, gathers_blocks=False, ds_buckets=2,
                                    master_partition=True, fresh_grad_partition=True),
    "fsdp2": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True, gathered_blocks=3,
                          keeps_root=True, staged=True),
    # ZeRO-3 keeps a fetched parameter gathered while its next use is near (stage3_max_reuse_distance): up to
    # stage3_max_live_parameters elements (ZERO3_MAX_LIVE, DeepSpeed's default: memfit leaves it) stay gathered.
    "deepspeed_zero3": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True, ds_buckets=1,
                                    master_partition=True, live_limited=True),
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
                   master_bytes: int | None = None, root_bytes: int = 0, root_grad_bytes: int = 0,
                   n_blocks: int = 0, live_bytes: int = 0) -> dict[str, Any]:
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
    twice them where DeepSpeed trains a bf16 model). root_bytes / root_grad_bytes: FSDP2's root unit (what is
    outside the blocks) as gathered, and its unsharded gradients (0 where the moment holds none yet). n_blocks:
    the model's blocks (0: unknown: the rule's count of blocks). live_bytes: ZeRO-3's stage3_max_live_parameters
    at the weights' width (0 or n_blocks unknown: two blocks, as the rule counts). Returns
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
        # Unsharded blocks (the one computing, the next prefetched; FSDP2 also the last, kept after forward), the
        # root unit where it stays gathered, and the full gradients of one block (FSDP2: and the reduce-scatter's
        # input) and of the root unit.
        if block_grad_bytes is None:
            block_grad_bytes = int(block_bytes * (grads / params if params else 1.0))
        gathered = int(block_bytes if gathered_block_bytes is None else gathered_block_bytes)
        if rule.live_limited and n_blocks and live_bytes:  # every unit, up to the live limit
            weights = min(n_blocks * gathered + int(root_bytes), live_bytes)
        else:
            blocks = min(rule.gathered_blocks, n_blocks) if n_blocks else rule.gathered_blocks
            weights = blocks * gathered + (int(root_bytes) if rule.keeps_root else 0)
        transient = weights + (1 + rule.staged) * int(block_grad_bytes) + (int(root_grad_bytes) if rule.staged else 0)
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
              ds_bucket_bytes: int = 0, master: int | None = None, block_fraction: float = 0.0,
              head_fraction: float = 0.0, live_fraction: float = 0.0) -> dict[str, Any]:
    """Pure: one rank's per_rank_bytes row at the moment where it peaks, which need not be one process's (sharding
    shrinks the state, not the activations). `moments`: each moment's phase and bytes, in order, no reference copy.
    After the loss's own backward, a fully sharded rank holds unsharded gradients (a block's; FSDP2's root unit's:
    the head's, at the backward's last moment the embeddings' too) and a ZeRO-2 rank a second gradient partition.
    `trained`: every gradient's bytes. block_fraction / head_fraction: a block's and the head's shares of the
    parameters (0: spread evenly over the blocks). FSDP2 under bf16-mixed gathers weights in bf16."""
    n = max(1, n_blocks)
    width = 2 if strategy == "fsdp2" and precision == "bf16-mixed" else 1
    fresh = RULES[strategy].fresh_grad_partition

    def row(phase: str, params: int, grads: int, optim: int, acts: int) -> dict[str, Any]:
        backward = phase in ("backward", "last")
        block = int(params * block_fraction) if block_fraction else params // n
        root = max(0, params - n * block)
        root_grads = trained * root // max(1, params) if phase == "last" else int(trained * head_fraction)
        return per_rank_bytes(params, grads + (trained if fresh and backward else 0), optim, acts, strategy,
                              world_size, block_bytes=block, reference_bytes=reference_bytes,
                              offload_optimizer=offload_optimizer, trained_bytes=trained,
                              block_grad_bytes=trained * block // max(1, params) if backward else 0,
                              gathered_block_bytes=block // width, ds_bucket_bytes=ds_bucket_bytes,
                              master_bytes=master, root_bytes=root // width, n_blocks=n_blocks,
                              root_grad_bytes=root_grads // width if backward else 0,
                              live_bytes=int(params * live_fraction))

    labelled = []  # the loss's backward, before any parameter's gradient: "loss"; the backward's last moment: "last"
    for i, (phase, v) in enumerate(moments):
        after, before = (moments[i + 1][0] if i + 1 < len(moments) else "step"), (moments[i - 1][0] if i else "")
        first, last = phase == "backward" and before == "forward", phase == "backward" and after != "backward"
        labelled.append(("loss" if first else "last" if last else phase, v))
    rows = (row(phase, *parts) for phase, parts in {(p, rank_parts(v, p)) for p, v in labelled})  # alike: once
    return max(rows, key=lambda r: r["total"])


def rank_share(estimate: Any, *, strategy: str, world_size: int, limit: int | None, offload_optimizer: bool = False,
               reference_copy_set: bool = False, ds_bucket_elements: int = 0,
               bf16_model: Callable[[Any], Any] | None = None, unit_fractions: tuple[float, float] = (0, 0)) -> Any:
    """One process's estimate (traced at one rank's rows, with its moments) as one rank's under `strategy` (auto:
    ddp or fsdp2 by choose_strategy's rule against `limit`, the budget less its margin): the peak and breakdown
    become the rank's; the strategy, why, and every strategy's row are kept in extra["ranks"] (for `memfit plan`
    and phase 2). bf16_model: the same step traced in bf16-true (moments kept), for DeepSpeed and FSDP2 under
    bf16-mixed. unit_fractions: one block's and the output head's shares of the parameters (rank_peak)."""
    ref = int(estimate.extra.get("reference_bytes") or 0)
    n_blocks = len(estimate.kinds)
    plain = _rank_basis(estimate, ds_bucket_elements)  # compose keeps the moments when the estimator has a share
    traced = bf16_model(estimate) if bf16_model is not None and estimate.stack.precision == "bf16-mixed" else None
    deepspeed = _deepspeed_in_bf16(traced, ds_bucket_elements)
    fsdp2 = _fsdp2_in_bf16(traced, plain) if estimate.stack.quantize == "none" else None
    bases = {"deepspeed_zero2": deepspeed, "deepspeed_zero3": deepspeed, "fsdp2": fsdp2}

    def peak(s: str, offload: bool = False) -> dict[str, Any]:
        b = bases.get(s) or plain
        return rank_peak(b.moments, s, world_size, n_blocks, b.trained, ref, offload, b.precision, b.bucket, b.master,
                         *unit_fractions, min(1.0, ZERO3_MAX_LIVE / max(1, estimate.n_params)))

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


def _deepspeed_in_bf16(traced: Any, ds_bucket_elements: int) -> RankBasis | None:
    """Under bf16-mixed DeepSpeed holds the model itself in bf16 (its `bf16` section converts the module), not fp32
    weights under autocast: bf16 weights and gradients, an fp32 master copy of the trained weights and fp32 AdamW
    moments (its own AdamW, 8 B a trained parameter, whatever memory.optimizer says). So its rows come from the
    step traced in bf16-true (`traced`; None: not bf16-mixed), the optimizer state made fp32. Counted from the
    bf16-mixed trace, ZeRO-2 and ZeRO-3 ranks of the tiny model read 1.34x what they held (docs/distributed.md)."""
    if traced is None:
        return None
    basis = _rank_basis(traced, ds_bucket_elements)  # bf16 gradients: 2 B a trained parameter
    moments = [(phase, {**v, "optimizer": 4 * basis.trained}) for phase, v in basis.moments]  # fp32 m and v: 8 B
    return replace(basis, moments=moments, master=2 * basis.trained)


def _fsdp2_in_bf16(traced: Any, plain: RankBasis) -> RankBasis | None:
    """FSDP2 under bf16-mixed (MixedPrecisionPolicy, bf16 parameters in compute) runs the whole forward in bf16,
    the residual stream too, where autocast keeps it in fp32: its activations are the bf16-true trace's, while its
    sharded state stays fp32 (weights and gradients twice the traced bf16 ones, the optimizer state as memfit's
    optimizer keeps it). From the autocast trace a rank of the tiny model read 1.135x what it held."""
    if traced is None:
        return None
    optimizer = max(int(v.get("optimizer", 0)) for _, v in plain.moments)
    moments = [(phase, {**v, "params": 2 * v.get("params", 0), "grads": 2 * v.get("grads", 0), "optimizer": optimizer,
                        "other": v.get("other", 0) * (2 if phase == "step" else 1)})
               for phase, v in traced.moments]
    return replace(plain, moments=moments)
