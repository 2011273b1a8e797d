"""memory_bench.py's rows for the memory techniques besides checkpointing: chunked loss, AdamW variants, lean layers.

Each row is one technique on the reference workload, every block fully checkpointed (so the head, loss and
optimizer are where the memory goes): the peak measured by memfit's tracker on real tensors beside the
estimator's, the saving against the plain stack (plain loss, torch's default AdamW, step after backward) both
ways, and the step time as a ratio to the plain stack (median over rounds of blocks of steps, as the policy rows).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit.memory.estimator.compose import Stack
from memfit.memory.estimator.estimate import Estimator
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.techniques.lean_layers import apply_lean_layers
from memfit.memory.techniques.loss import loss_by_name
from memfit.memory.techniques.policies import assign_blocks, find_blocks

MB = 1e6
# name -> what differs from the plain stack; adamw-cpu-offload needs CUDA and joins the rows there.
TECHNIQUES: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked loss": {"loss": "chunked"},
    "adamw-fused": {"optimizer": "adamw-fused"},
    "adamw-8bit": {"optimizer": "adamw-8bit"},
    "step in backward": {"optimizer_in_backward": True},
    "chunked + 8-bit + step in backward": {"loss": "chunked", "optimizer": "adamw-8bit",
                                           "optimizer_in_backward": True},
    "lean layers": {"lean_layers": True},
    "chunked + lean layers": {"loss": "chunked", "lean_layers": True},
}


@dataclass
class Row:
    name: str
    stack: Stack
    measured_peak: int = 0
    estimated_peak: int = 0
    blocks_s: list[float] = field(default_factory=list)


def _available(name: str, device: str) -> bool:
    if "8-bit" in name or "8bit" in name:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            print(f"  {name}: skipped (pip install bitsandbytes)")
            return False
    return True


def _step(model, optimizer, stack: Stack, batch: torch.Tensor, tracker: StepTracker | None = None) -> None:
    run_step(model, optimizer, [batch], stack.precision, tracker, None, loss_by_name(stack.loss, 1024),
             in_backward=stack.optimizer_in_backward)


def technique_rows(build, args, policy_est: Estimator, clock) -> tuple[str, list[dict[str, Any]]]:
    """Measure, estimate and time every technique; the markdown table and the JSON rows."""
    # No clipping anywhere: the step in backward cannot clip, and the rows must differ by one thing only.
    est = Estimator(policy_est.hf_config, policy_est.seq_len, policy_est.profile, max_grad_norm=None)
    techniques = dict(TECHNIQUES)
    if args.device == "cuda":
        techniques["adamw-cpu-offload + step in backward"] = {"optimizer": "adamw-cpu-offload",
                                                               "optimizer_in_backward": True}
    base = Stack(args.precision, args.batch, 1, False, loss="plain", optimizer="adamw")
    rows = [Row(name, replace(base, **change)) for name, change in techniques.items()
            if _available(name, args.device)]
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    runs = []
    for row in rows:
        model = build(args)
        if row.stack.lean_layers:
            apply_lean_layers(model)
        n = len(find_blocks(model))
        assign_blocks(model, ["full"] * n)
        optimizer = make_optimizer(model, kind=row.stack.optimizer)
        init_optimizer_state(optimizer)
        tracker = StepTracker(find_blocks(model))
        tracker.track_external(model, optimizer)
        with tracker:
            _step(model, optimizer, row.stack, batch, tracker)
        row.measured_peak = tracker.result().peak_bytes
        row.estimated_peak = est.estimate(row.stack, ("full",) * n).peak_bytes
        print(f"  {row.name:<40} peak {row.measured_peak / MB:8.1f} MB (est {row.estimated_peak / MB:8.1f})",
              flush=True)
        runs.append((row, model, optimizer))
    for r in range(args.rounds):
        for row, model, optimizer in runs:
            _step(model, optimizer, row.stack, batch)  # warm-up in this mode
            t0 = clock(args)
            for _ in range(args.steps):
                _step(model, optimizer, row.stack, batch)
            row.blocks_s.append((clock(args) - t0) / args.steps)
        print(f"  techniques: timing round {r + 1}/{args.rounds} done", flush=True)
    plain = rows[0]
    base_t = statistics.median(plain.blocks_s)
    lines = ["| technique (every block fully checkpointed) | peak MB (est) | saving MB (est) | saving est/measured "
             "| step time x plain |", "|---|---|---|---|---|"]
    data = []
    for row in rows:
        saved, saved_est = plain.measured_peak - row.measured_peak, plain.estimated_peak - row.estimated_peak
        agree = f"{saved_est / saved:.3f}" if saved else "-"
        ratio = statistics.median(row.blocks_s) / base_t
        lines.append(f"| {row.name} | {row.measured_peak / MB:.1f} ({row.estimated_peak / MB:.1f}) | "
                     f"{saved / MB:.1f} ({saved_est / MB:.1f}) | {agree} | {ratio:.3f} |")
        data.append({"technique": row.name, "measured_peak_bytes": row.measured_peak,
                     "estimated_peak_bytes": row.estimated_peak, "measured_saving_bytes": saved,
                     "estimated_saving_bytes": saved_est, "step_time_ratio": ratio,
                     "step_seconds_blocks": row.blocks_s})
    return "\n".join(lines), data
