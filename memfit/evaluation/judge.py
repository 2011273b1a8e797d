"""Phase 5's judging of an export: eval.tasks and eval.sets on the challenger and on the champion, side by side."""

from __future__ import annotations

import hashlib
import json
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
KEY_TAG = "memfit.eval_key"  # the run's eval_key: a later challenger reuses these scores when its key is equal


@dataclass
class Judged:
    """One export's scores: the harness's tasks and the own sets."""

    tasks: TaskScores = field(default_factory=TaskScores)
    sets: list[SetResult] = field(default_factory=list)
    preference: dict[str, float] = field(default_factory=dict)  # a DPO run's held-out pairs (eval/preference/...)

    @property
    def metrics(self) -> dict[str, float]:
        out = dict(self.tasks.metrics)
        for s in self.sets:
            out.update(s.metrics())
        return out | self.preference


def judge_export(cfg: Any, hf_dir: str | Path, device: str, pairs: Any = None) -> Judged:
    """eval.tasks (the harness's HF backend), eval.sets (greedy answers) and, for a DPO run, its held-out `pairs`
    (rows, fields) on the SafeTensors folder `hf_dir`."""
    judged = Judged(tasks=run_tasks(hf_dir, cfg.eval, device) if cfg.eval.tasks else TaskScores())
    if cfg.eval.sets or pairs is not None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        start = time.perf_counter()
        from memfit.evaluation.dtype import TORCH

        # eval.dtype as phase 5 resolved it (the champion is judged in the same dtype as the challenger)
        dtype = TORCH.get(cfg.eval.dtype, torch.float32)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
        if cfg.eval.sets:
            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
            judged.sets = run_sets(model, tokenizer, cfg.eval.sets, torch.device(device), cfg.eval.max_new_tokens)
            judged.tasks.seconds["sets"] = round(time.perf_counter() - start, 3)
        if pairs is not None:
            from memfit.evaluation.preference import PREFERENCE, preference_scores

            start = time.perf_counter()
            judged.preference = preference_scores(model, *pairs, cfg.train.micro_batch_size, torch.device(device),
                                                  cfg.eval.limit)
            judged.tasks.seconds[PREFERENCE] = round(time.perf_counter() - start, 3)
        del model
    return judged


def eval_key(eval_cfg: Any, pairs_key: str | None = None) -> str:
    """What decides the scores besides the model: the tasks and every file under eval.task_paths (their YAMLs and
    local data), the sets' files and settings, the harness's settings and version, memfit's generation settings.
    A champion judged under the same key is not judged again; any change to a set or task file changes it."""
    from importlib.metadata import PackageNotFoundError, version

    def files(folder: str) -> list[tuple[str, str]]:
        root = Path(folder).expanduser()
        return [(str(p.relative_to(root)), _digest(p)) for p in sorted(root.rglob("*")) if p.is_file()]

    try:
        harness = version("lm_eval")
    except PackageNotFoundError:
        harness = None
    parts = {"tasks": eval_cfg.tasks, "task_files": [files(f) for f in eval_cfg.task_paths],
             "sets": [{**s.model_dump(mode="json"), "path": _digest(Path(s.path).expanduser())}
                      for s in eval_cfg.sets],
             "limit": eval_cfg.limit, "num_fewshot": eval_cfg.num_fewshot, "batch_size": eval_cfg.batch_size,
             "max_new_tokens": eval_cfg.max_new_tokens, "harness": harness, "format": 1,
             **({"pairs": pairs_key} if pairs_key else {}),
             **({"dtype": eval_cfg.dtype} if eval_cfg.dtype not in ("fp32", "auto") else {})}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def current(cfg: Any, run_id: str) -> Any:
    """The champion to judge against (registry's alias), or None: none yet, comparing off, or this very run."""
    if not (cfg.eval.compare_champion and cfg.registry.enabled):
        return None
    from mlflow import MlflowClient

    from memfit.release.registry import current_champion

    uri = cfg.tracking.resolved_uri()
    champion = current_champion(MlflowClient(tracking_uri=uri, registry_uri=uri),
                                cfg.registry.model_name or cfg.run.name, cfg.registry.alias)
    return None if champion is None or champion.run_id == run_id else champion


def recorded_scores(cfg: Any, champion: Any, key: str, with_pairs: bool = False) -> Judged | None:
    """The champion's scores as its own run recorded them, when judged under the same eval key (its metrics and its
    sets' per-example rows), else None: judge it again."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = cfg.tracking.resolved_uri()
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(champion.run_id)
        if run.data.tags.get(KEY_TAG) != key:
            return None
        metrics = {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")}
        preference = {k: v for k, v in metrics.items() if k.startswith("eval/preference/")}
        sets = []
        for s in cfg.eval.sets:
            table = json.loads(Path(client.download_artifacts(run.info.run_id, f"eval/sets/{s.name}.json"))
                               .read_text())
            sets.append(SetResult(s.name, [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]))
    except (MlflowException, OSError, ValueError, KeyError) as err:
        log.info("the champion's recorded scores are unreadable (%s): judging it again", err)
        return None
    judged = Judged(tasks=TaskScores(metrics={k: v for k, v in metrics.items()
                                              if k.split("/")[1] in cfg.eval.tasks}), sets=sets,
                    preference=preference if with_pairs else {})
    missing = [t for t in cfg.eval.tasks if not any(k.startswith(f"eval/{t}/") for k in judged.tasks.metrics)]
    return None if missing or (with_pairs and not preference) else judged


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


def judge(cfg: Any, hf_dir: str, device: str, tracker: Any, step: int, work: Path, run_id: str,
          pairs: Any = None) -> dict[str, float]:
    """Score the challenger's export, and the champion's on the same data (a DPO run's held-out `pairs` too); log
    both, the per-example tables, and return the metrics the gate reads (the champion's under champion/eval/...)."""
    ours = judge_export(cfg, hf_dir, device, pairs)
    log_scores(tracker, ours.tasks, step, work / "tasks")
    for s in ours.sets:
        tracker.log_table({k: [r[k] for r in s.rows] for k in s.rows[0]}, f"eval/sets/{s.name}.json")
    metrics = ours.metrics
    from memfit.data.pairs import pairs_digest

    key = eval_key(cfg.eval, pairs_digest(*pairs) if pairs is not None else None)
    tracker.set_tags({KEY_TAG: key})
    champion = current(cfg, run_id)
    theirs = recorded_scores(cfg, champion, key, pairs is not None) if champion is not None else None
    if theirs is not None:
        log.info("the champion (v%s) was judged on the same tasks and sets (eval key %s): its recorded scores are "
                 "used", champion.version, key)
        tracker.set_tags({"memfit.champion_scores": f"recorded by run {champion.run_id}"})
    elif champion is not None:
        from memfit.release.registry import fetch_champion

        dest = work / "champion"
        shutil.rmtree(dest, ignore_errors=True)
        theirs = judge_export(cfg, fetch_champion(cfg.tracking.resolved_uri(), cfg.registry.model_name or cfg.run.name,
                                                  dest, cfg.registry.alias), device, pairs)
        tracker.set_tags({"memfit.champion_scores": f"judged again (v{champion.version})"})
    if theirs is not None:
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
