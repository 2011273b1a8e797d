"""Phase 5 for a DPO run: how often a model prefers each held-out pair's chosen answer (eval/preference/...)."""

from __future__ import annotations

import math

import torch

PREFERENCE = "preference"  # the source name in eval.gate.metrics (preference/accuracy), beside tasks and sets


@torch.no_grad()
def preference_scores(model: torch.nn.Module, rows: torch.Tensor, fields: dict[str, torch.Tensor],
                      batch_size: int, device: torch.device, limit: int | None = None) -> dict[str, float]:
    """The model alone ranks each held-out pair by mean log-prob per completion token, as the DPO objective's
    val_preference_accuracy does (no reference: the champion and the challenger are scored alike, whatever their
    reference was). accuracy (with its standard error), margin (chosen minus rejected, nats a token), pairs."""
    from memfit.memory.techniques.loss import blocks_batch
    from memfit.training.objective import policy_logps

    was_training = model.training
    model.eval()
    n = len(rows) if limit is None else min(limit, len(rows))
    wins, margins = [], []
    for i in range(0, n, batch_size):
        batch = blocks_batch(rows, slice(i, min(i + batch_size, n)), device, fields)
        summed, counts = policy_logps(model, batch)
        mean = (summed / counts.clamp(min=1)).float().cpu()
        pairs = mean.shape[0] // 2
        wins.append((mean[:pairs] > mean[pairs:]).float())
        margins.append(mean[:pairs] - mean[pairs:])
    model.train(was_training)
    if not wins:
        return {}
    won, margin = torch.cat(wins), torch.cat(margins)
    acc = float(won.mean())
    stderr = math.sqrt(acc * (1 - acc) / (len(won) - 1)) if len(won) > 1 else 0.0
    key = f"eval/{PREFERENCE}"
    return {f"{key}/accuracy": acc, f"{key}/accuracy_stderr": stderr, f"{key}/margin": float(margin.mean()),
            f"{key}/pairs": float(len(won))}
