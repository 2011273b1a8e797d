"""How parameters, gradients and optimizer state divide across ranks per strategy: pure byte arithmetic."""

# The estimator (or the baseline probe) says what ONE process needs; `per_rank_bytes` says what each rank
# needs under a data-parallel strategy, and `choose_strategy` picks the cheapest strategy that fits a
# per-device budget. Nothing here touches torch or a device, so `memfit plan` can answer for 8 GPUs on a
# laptop. Rules (data parallel throughout; the model is never split by layer or by tensor):
#
# | strategy        | params | grads | optimizer state | transient per rank                          |
# |-----------------|--------|-------|-----------------|---------------------------------------------|
# | single, ddp     | full   | full  | full            | none (DDP uses gradient_as_bucket_view)     |
# | deepspeed_zero2 | full   | / N   | / N             | none                                        |
# | fsdp2           | / N    | / N   | / N             | all-gathered block params (this one and the |
# | deepspeed_zero3 | / N    | / N   | / N             | prefetched next) + that block's full grads  |
#
# `offload_optimizer` (DeepSpeed only) moves the optimizer state to CPU memory: it leaves the device total
# and is reported as `cpu_offload`. Activations are never divided: each rank holds the activations of its
# own micro-batch, which is the global micro-batch / world size (`activations` is that per-rank figure).

from __future__ import annotations

import math
from dataclasses import dataclass
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


RULES: dict[str, ShardingRule] = {
    "single": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False),
    "ddp": ShardingRule(params=False, grads=False, optim=False, gathers_blocks=False),
    "deepspeed_zero2": ShardingRule(params=False, grads=True, optim=True, gathers_blocks=False),
    "fsdp2": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True),
    "deepspeed_zero3": ShardingRule(params=True, grads=True, optim=True, gathers_blocks=True),
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


def _shard(nbytes: int, divide: bool, world_size: int) -> int:
    # Each rank holds ceil(n / N): shards are padded to equal size (FSDP2 pads dim 0, ZeRO pads flat buffers).
    return math.ceil(nbytes / world_size) if divide else int(nbytes)


def per_rank_bytes(params: int, grads: int, optim: int, activations: int, strategy: str, world_size: int, *,
                   block_bytes: int = 0, offload_optimizer: bool = False) -> dict[str, Any]:
    """Bytes ONE rank needs for the training state under `strategy` on `world_size` ranks.

    params / grads / optim: what a single process holds for the whole model (e.g. fp32 AdamW: 4, 4 and
    8 bytes per trainable parameter; include fp32 master weights in `optim` when the strategy keeps them).
    activations: the peak activation bytes of one rank's micro-batch. block_bytes: parameter bytes of the
    largest decoder block (fully sharded strategies all-gather two at a time and hold one block's full
    gradients before the reduce-scatter; 0 leaves this transient out). Returns the parts, their `total`
    on the device, `cpu_offload` bytes, and which parts are `sharded`.
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
                        ("block_bytes", block_bytes)):
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
        grad_per_param = grads / params if params else 1.0
        # Two unsharded blocks (the one computing, the next prefetched) + the full grads of one block.
        transient = 2 * int(block_bytes) + int(block_bytes * grad_per_param)
    total = out_params + out_grads + out_optim + int(activations) + transient
    return {
        "strategy": strategy, "world_size": world_size, "params": out_params, "grads": out_grads,
        "optim": out_optim, "activations": int(activations), "transient": transient, "total": total,
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
                    budget_bytes: int | None, *, block_bytes: int = 0) -> tuple[str, str, dict[str, Any]]:
    """`distributed.strategy=auto`: (strategy, why, its per-rank bytes).

    ddp when a full replica fits the budget (fastest: one all-reduce, no gathers); otherwise fsdp2
    (parameters, gradients and optimizer state sharded). fsdp2 is also the answer when nothing fits; the
    reason says so and names the ways out (more ranks, gradient checkpointing, DeepSpeed offload).
    """
    if world_size == 1:
        est = per_rank_bytes(params, grads, optim, activations, "single", 1)
        return "single", "one process: nothing to divide", est
    ddp = per_rank_bytes(params, grads, optim, activations, "ddp", world_size)
    if budget_bytes is None:
        return "ddp", "no memory budget known: replicate the model (ddp, fastest)", ddp
    if ddp["total"] <= budget_bytes:
        return "ddp", (f"a full replica needs {human(ddp['total'])} per rank, within the "
                       f"{human(budget_bytes)} budget: ddp"), ddp
    fsdp = per_rank_bytes(params, grads, optim, activations, "fsdp2", world_size, block_bytes=block_bytes)
    if fsdp["total"] <= budget_bytes:
        return "fsdp2", (f"a full replica needs {human(ddp['total'])} per rank, over the "
                         f"{human(budget_bytes)} budget; sharded over {world_size} ranks it needs "
                         f"{human(fsdp['total'])}: fsdp2"), fsdp
    return "fsdp2", (f"even sharded over {world_size} ranks the step needs {human(fsdp['total'])} per rank, "
                     f"over the {human(budget_bytes)} budget: add ranks, use gradient checkpointing, or "
                     "deepspeed_zero3 with distributed.offload_optimizer=true"), fsdp


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of per_rank_bytes results (GB), one row per strategy: for `memfit plan`."""
    head = f"{'strategy':<16}{'ranks':>6}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'transient':>10}" \
           f"{'total/rank':>12}{'cpu':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['strategy']:<16}{r['world_size']:>6}" + "".join(
            f"{r[k] / GB:>9.2f}" for k in ("params", "grads", "optim", "activations"))
            + f"{r['transient'] / GB:>10.2f}{r['total'] / GB:>12.2f}{r['cpu_offload'] / GB:>8.2f}")
    return "\n".join(lines)


def per_gpu_text(d: dict[str, Any]) -> str:
    """`memfit plan` with several ranks: the strategy chosen and every strategy's share per GPU."""
    return (f"\nper GPU on {d['world_size']} ranks: {d['strategy']} ({d['reason']})\n"
            + format_table(list(d["strategies"].values())))
