"""Phase 5's judging of an export: eval.tasks and eval.sets on the challenger and on the champion, side by side."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.evaluation.sets import SetResult, run_sets
from memfit.evaluation.tasks import TaskScores, log_scores, run_tasks

log = logging.getLogger("memfit.evaluation.judge")
CHAMPION = "champion/"  # the champion's scores on the same data, logged in the challenger's run


@dataclass
class Judged:
    """One export's scores: the harness's tasks and the own sets."""

    tasks: TaskScores = field(default_factory=TaskScores)
    sets: list[SetResult] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        out = dict(self.tasks.metrics)
        for s in self.sets:
            out.update(s.metrics())
        return out


def judge_export(cfg: Any, hf_dir: str | Path, device: str) -> Judged:
    """eval.tasks (the harness's HF backend) and eval.sets (greedy answers) on the SafeTensors folder `hf_dir`."""
    judged = Judged(tasks=run_tasks(hf_dir, cfg.eval, device) if cfg.eval.tasks else TaskScores())
    if cfg.eval.sets:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        judged.sets = run_sets(model, tokenizer, cfg.eval.sets, torch.device(device), cfg.eval.max_new_tokens)
        judged.tasks.seconds["sets"] = round(time.perf_counter() - start, 3)
        del model
    return judged


def champion_export(cfg: Any, run_id: str, dest: Path) -> Path | None:
    """The champion's SafeTensors folder (downloaded, checksums verified), or None: no champion, comparing off, or
    the champion is this very run (a rerun of a finished run)."""
    if not (cfg.eval.compare_champion and cfg.registry.enabled):
        return None
    from mlflow import MlflowClient

    from memfit.release.registry import current_champion, fetch_champion

    uri = cfg.tracking.resolved_uri()
    name = cfg.registry.model_name or cfg.run.name
    champion = current_champion(MlflowClient(tracking_uri=uri, registry_uri=uri), name, cfg.registry.alias)
    if champion is None or champion.run_id == run_id:
        return None
    shutil.rmtree(dest, ignore_errors=True)
    return fetch_champion(uri, name, dest, cfg.registry.alias)


def side_by_side(ours: SetResult, theirs: SetResult) -> dict[str, list[Any]]:
    """Pure: one row per example: prompt, reference, both answers and both scores (an MLflow table)."""
    table: dict[str, list[Any]] = {"prompt": [], "reference": [], "champion": [], "challenger": []}
    for a, b in zip(theirs.rows, ours.rows, strict=True):
        table["prompt"].append(b["prompt"])
        table["reference"].append(b["reference"])
        table["champion"].append(a["answer"])
        table["challenger"].append(b["answer"])
        for key in (k for k in b if k.startswith("score/")):
            table.setdefault(f"champion_{key[6:]}", []).append(a[key])
            table.setdefault(f"challenger_{key[6:]}", []).append(b[key])
    return table


def judge(cfg: Any, hf_dir: str, device: str, tracker: Any, step: int, work: Path, run_id: str) -> dict[str, float]:
    """Score the challenger's export, and the champion's on the same data; log both, the per-example tables, and
    return the metrics the gate reads (the champion's under champion/eval/...)."""
    ours = judge_export(cfg, hf_dir, device)
    log_scores(tracker, ours.tasks, step, work / "tasks")
    for s in ours.sets:
        tracker.log_table({k: [r[k] for r in s.rows] for k in s.rows[0]}, f"eval/sets/{s.name}.json")
    metrics = ours.metrics
    champion_dir = champion_export(cfg, run_id, work / "champion")
    if champion_dir is not None:
        theirs = judge_export(cfg, champion_dir, device)
        metrics.update({CHAMPION + k: v for k, v in theirs.metrics.items()})
        for mine, other in zip(ours.sets, theirs.sets, strict=True):
            tracker.log_table(side_by_side(mine, other), f"eval/compare/{mine.name}.json")
        log_scores(tracker, TaskScores(samples={f"champion_{k}": v for k, v in theirs.tasks.samples.items()}),
                   step, work / "champion-tasks")
        log.info("judged the champion on the same tasks and sets: %s",
                 {k: round(v, 4) for k, v in theirs.metrics.items() if not k.endswith("_stderr")})
    # The sets' scores and sizes, and the champion's figures (the tasks' own went with log_scores).
    tracker.log_metrics({k: v for k, v in metrics.items() if k not in ours.tasks.metrics}
                        | {f"eval/{s.name}/examples": float(len(s.rows)) for s in ours.sets}, step=step)
    return metrics
