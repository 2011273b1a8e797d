"""The memory commands that need no run: estimate one step's peak, plan the stack, find the longest sequence."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memfit.cli.common import PROCESS, ConfigArg, JsonOpt, SetOpt, environment, fail, load
from memfit.errors import ConfigError, MemfitError
from memfit.runtime.importing import collector_paused

GB = 1e9  # memfit plan's per-GPU table is in GB

DeviceOpt = Annotated[str | None, typer.Option("--device", help="Target device profile: a100-40gb, a100-80gb, "
                                                "h100-80gb, h200, l4, rtx-4090, t4, cpu.")]
BudgetOpt = Annotated[float | None, typer.Option("--budget-gb", help="Memory budget in GB (overrides the device's).")]


def estimate(config: ConfigArg = None, set_: SetOpt = None, device: DeviceOpt = None, budget_gb: BudgetOpt = None,
             policy: Annotated[str | None, typer.Option("--policy", help="Gradient-checkpointing policy to estimate "
                                                        "(default: memory.policy).")] = None,
             as_json: JsonOpt = False) -> None:
    """Predict the peak memory of one training step (params, grads, optimizer, activations, other) without
    allocating it: the step runs on fake tensors, so any model size works from its config.json alone."""
    environment()
    try:
        cfg = load(config, set_)
        with collector_paused(freeze=PROCESS.own):
            from memfit.memory.planner.search import estimate_report

        if policy is not None and policy not in ("auto", "none", "full", "every_k", "selective", "offload"):
            raise ConfigError(f"--policy: unknown policy {policy!r}; choose one of auto, none, full, every_k, "
                              "selective, offload")
        out = estimate_report(cfg, device, budget_gb, policy)
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
        return
    from memfit.memory.estimator.breakdown import estimate_text

    typer.echo(estimate_text(out))


def _max_seq(config: Any, set_: Any, device: str | None, budget_gb: float | None, as_json: bool) -> None:
    try:
        with collector_paused(freeze=PROCESS.own):
            from memfit.memory.planner.max_seq import max_seq_report

        out = max_seq_report(load(config, set_), device, budget_gb)
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
    else:
        s = out["stack"]
        typer.echo(f"longest data.seq_len that fits {out['limit_bytes'] / 1e9:.4g} GB on {out['device']}: "
                   f"{out['max_seq_len']} tokens with {s['policy']}, {s['precision']}, micro-batch "
                   f"{s['micro_batch_size']}{', LoRA' if s['lora'] else ''}"
                   f"{', NF4 base' if s['quantize'] == 'nf4' else ''}")
        if out["note"]:
            typer.echo(f"note: {out['note']}")
    if out["max_seq_len"] == 0:
        if not as_json:
            typer.echo("error: no sequence length fits the budget with this stack", err=True)
        raise typer.Exit(2)


def plan(config: ConfigArg = None, set_: SetOpt = None, device: DeviceOpt = None, budget_gb: BudgetOpt = None,
         max_seq: Annotated[bool, typer.Option("--max-seq", help="Also report the longest data.seq_len that fits "
                                               "the budget with the chosen stack (a search over estimates).")]
         = False, as_json: JsonOpt = False) -> None:
    """Choose the optimisation stack (checkpointing per block, precision, micro-batch, LoRA, a 4-bit base) that
    fits the budget with the least predicted slowdown, and show the candidates it weighed."""
    environment()
    if max_seq:
        _max_seq(config, set_, device, budget_gb, as_json)
        return
    try:
        cfg = load(config, set_)
        with collector_paused(freeze=PROCESS.own):
            from memfit.memory.planner.plan import plan_table_markdown
            from memfit.memory.planner.search import plan_report
            from memfit.run_context import measured_peaks_for

        # Stacks this run was stopped at the memory limit with (recovery.on_memory_limit leaner) are out.
        result, out = plan_report(cfg, device, budget_gb, measured=measured_peaks_for(cfg))
        if cfg.distributed.world_size > 1:
            from memfit.memory.planner.search import per_gpu_report

            out["distributed"] = per_gpu_report(result, cfg.distributed.world_size)
        if cfg.data.packing == "auto":  # the layouts weighed, like the stacks: predicted time per trained token
            from memfit.data.layout import format_layouts
            from memfit.run_context import packing_alternatives

            out["packing"], out["packing_candidates"] = packing_alternatives(cfg, device)
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
    else:
        typer.echo(result.reason)
        typer.echo(plan_table_markdown(result))
        if "evaluation" in out:
            typer.echo(out["evaluation"]["line"])
        if "packing" in out:
            typer.echo(format_layouts(out["packing"], out["packing_candidates"]))
        if "distributed" in out and "strategies" in out["distributed"]:
            typer.echo(per_gpu_text(out["distributed"]))
    # Several ranks: what must fit is one GPU's share under the strategy, not a single-process replica.
    fits = out["distributed"].get("fits", False) if "distributed" in out else out["fits"]
    if not fits:
        if not as_json:
            typer.echo(f"error: {out['distributed'].get('error') or 'the per-GPU share does not fit the budget'}"
                       if "distributed" in out else f"error: {out['error']}", err=True)
        raise typer.Exit(2)


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
