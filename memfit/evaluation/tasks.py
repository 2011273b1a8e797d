"""Benchmark tasks in phase 5: lm-evaluation-harness on the SafeTensors export, scores named eval/TASK/METRIC."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

log = logging.getLogger("memfit.evaluation.tasks")
INSTALL = "pip install 'memfit[eval]' (lm-eval[api])"


@dataclass
class TaskScores:
    """What the harness gave: metrics (eval/TASK/METRIC and its _stderr), seconds per task, per-sample records."""

    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def metric_names(task: str, results: dict[str, Any]) -> dict[str, float]:
    """Pure: the harness's `{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}` for one task →
    `{"eval/TASK/acc": 0.5, "eval/TASK/acc_stderr": 0.1}`; a filter other than `none` is kept as a suffix; values
    that are not finite numbers (the harness writes "N/A" for a stderr it cannot compute) are left out."""
    out = {}
    for key, value in results.items():
        name, _, filt = key.partition(",")
        if not filt or isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            continue
        out[f"eval/{task}/{name}" + ("" if filt == "none" else f"_{filt}")] = float(value)
    return out


def _harness() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"eval.tasks needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return lm_eval


def task_manager(paths: list[str], names: list[str]) -> Any:
    """The harness's task index: only the local folders when they hold every name (indexing the harness's own
    few thousand task YAMLs takes tens of seconds), else those too."""
    _harness()
    from lm_eval.tasks import TaskManager

    for p in paths:
        if not Path(p).expanduser().is_dir():
            raise ConfigError(f"eval.task_paths: {p} is not a folder; name folders that hold task YAML files")
    folders = [str(Path(p).expanduser()) for p in paths]
    if folders:
        local = TaskManager(include_path=folders, include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=folders or None)


def check_tasks(eval_cfg: Any) -> None:
    """Preflight: the harness is installed, every task name is known, a local task's data files exist."""
    if not eval_cfg.tasks:
        return
    manager = task_manager(eval_cfg.task_paths, eval_cfg.tasks)
    known = set(manager.all_tasks)
    for name in eval_cfg.tasks:
        if name not in known:
            raise ConfigError(f"eval.tasks: no lm-evaluation-harness task named {name!r} (its own tasks, or a YAML "
                              f"under eval.task_paths {eval_cfg.task_paths or '(none)'}); check the name")
        for data in _local_data_files(manager, name):
            if not data.exists():
                raise ConfigError(f"eval.tasks: task {name!r} reads {data}, which does not exist; fix dataset_kwargs."
                                  "data_files in its YAML")


def _local_data_files(manager: Any, name: str) -> list[Path]:
    """The data files a task YAML names in dataset_kwargs.data_files (the harness's own tasks name none)."""
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        return []
    doc = entry.cfg or {}
    files = (doc.get("dataset_kwargs") or {}).get("data_files") or {}
    listed = files.values() if isinstance(files, dict) else [files]
    found = []
    for item in listed:
        for f in [item] if isinstance(item, str) else list(item):
            path = Path(f).expanduser()
            found.append(path if path.is_absolute() else Path(entry.yaml_path).parent / path)
    return found


def run_tasks(hf_dir: str | Path, eval_cfg: Any, device: str) -> TaskScores:
    """Each task of eval.tasks on the export through the harness's Hugging Face backend (the model loaded once)."""
    lm_eval = _harness()
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(eval_cfg.task_paths, eval_cfg.tasks)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(eval_cfg.dtype, "float32")  # as phase 5 resolved eval.dtype
    model = HFLM(pretrained=str(hf_dir), device=device, dtype=dtype, batch_size=eval_cfg.batch_size)
    scores = TaskScores()
    for name in eval_cfg.tasks:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=[name], task_manager=manager, limit=eval_cfg.limit,
                                      num_fewshot=eval_cfg.num_fewshot, log_samples=True, bootstrap_iters=1000)
        scores.seconds[name] = round(time.perf_counter() - start, 3)
        for task, results in out["results"].items():
            scores.metrics.update(metric_names(task, results))
        for task, rows in (out.get("samples") or {}).items():
            scores.samples[task] = [_jsonable(r) for r in rows]
        log.info("eval task %s: %s in %.1f s", name, {k: round(v, 4) for k, v in scores.metrics.items()
                                                      if k.startswith(f"eval/{name}/")}, scores.seconds[name])
    return scores


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(row, default=str))


def log_scores(tracker: Any, scores: TaskScores, step: int, folder: Path) -> None:
    """Scores as metrics (with eval_seconds/TASK), the per-sample records as eval/tasks/TASK.jsonl artifacts."""
    tracker.log_metrics({**scores.metrics, **{f"eval_seconds/{k}": v for k, v in scores.seconds.items()}}, step=step)
    folder.mkdir(parents=True, exist_ok=True)
    for task, rows in scores.samples.items():
        path = folder / f"{task}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tracker.log_artifact(path, "eval/tasks")
