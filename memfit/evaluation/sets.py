"""The team's own eval sets: prompts (or conversations) with reference answers, answered greedily and scored."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

INSTALL = "pip install 'memfit[eval]'"


@dataclass
class SetResult:
    """One set on one model: a row per example (prompt, reference, answer, a score per metric) and the means."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """eval/SET/METRIC (the mean over examples) and eval/SET/METRIC_stderr (the standard error of that mean)."""
        out: dict[str, float] = {}
        for metric in [k for k in (self.rows[0] if self.rows else {}) if k.startswith("score/")]:
            values = [float(r[metric]) for r in self.rows]
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
            name = metric.removeprefix("score/")
            out[f"{prefix}/{self.name}/{name}"] = mean
            out[f"{prefix}/{self.name}/{name}_stderr"] = math.sqrt(var / len(values))
        return out


def load_set(set_cfg: Any) -> list[dict[str, Any]]:
    """The set's records: `prompt` (text) or `messages` (a conversation to answer), and `reference`; one line naming
    the file, the record and the field for anything else."""
    path = Path(set_cfg.path).expanduser()
    where = f"eval.sets[{set_cfg.name!r}]"
    if not path.is_file():
        raise ConfigError(f"{where}: {path} does not exist; point path at a JSONL file of prompt/reference records")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: {path} line {n} is not JSON ({err.msg}); one JSON object a line") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("reference"), str) or not rec["reference"].strip():
            raise ConfigError(f"{where}: {path} line {n} has no reference (a non-empty string); every record needs "
                              "the answer it is scored against")
        if not isinstance(rec.get("prompt"), str) and not isinstance(rec.get("messages"), list):
            raise ConfigError(f"{where}: {path} line {n} has neither prompt (a string) nor messages (a list)")
        records.append(rec)
    if not records:
        raise ConfigError(f"{where}: {path} holds no records")
    return records


def check_sets(sets: list[Any]) -> None:
    """Preflight: every set's file reads, every record has its fields, and its metrics' library is installed."""
    for s in sets:
        load_set(s)
        if {"exact_match", "rouge_l"} & set(s.metrics):
            _libraries()


@functools.cache  # one scorer for every answer of every set
def _libraries() -> tuple[Any, Any]:
    try:
        from lm_eval.api.metrics import exact_match_hf_evaluate
        from rouge_score import rouge_scorer
    except ImportError:
        raise ConfigError(f"eval.sets: the exact_match and rouge_l metrics need lm-eval and rouge-score: {INSTALL}"
                          ) from None
    return exact_match_hf_evaluate, rouge_scorer.RougeScorer(["rougeL"])


def extracted(answer: str, pattern: str | None) -> str:
    """The answer as scored: the first group (or whole match) of eval.sets[].extract, or the answer stripped."""
    if not pattern:
        return answer.strip()
    m = re.search(pattern, answer)
    if m is None:
        return ""
    return (m.group(1) if m.groups() else m.group(0)).strip()


def score_answer(answer: str, reference: str, metrics: list[str], extract: str | None) -> dict[str, float]:
    """Pure given the libraries: each metric's score of one answer (0..1)."""
    exact_match, rouge = _libraries() if {"exact_match", "rouge_l"} & set(metrics) else (None, None)
    got = extracted(answer, extract)
    out = {}
    for metric in metrics:
        if metric == "exact_match":
            out[metric] = float(exact_match(predictions=[got], references=[reference.strip()], ignore_case=True,
                                            ignore_punctuation=False)["exact_match"])
        elif metric == "contains":
            out[metric] = float(reference.strip().casefold() in got.casefold())
        elif metric == "rouge_l":
            out[metric] = float(rouge.score(reference, got)["rougeL"].fmeasure)
    return out


def prompt_of(tokenizer: Any, record: dict[str, Any]) -> str:
    if "prompt" in record:
        return record["prompt"]
    return tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)


def run_sets(model: Any, tokenizer: Any, sets: list[Any], device: Any, max_new_tokens: int) -> list[SetResult]:
    """Each set answered greedily (KV cache on, one prompt at a time) and scored."""
    from memfit.evaluation.review import generate_samples

    results = []
    for s in sets:
        records = load_set(s)
        prompts = [prompt_of(tokenizer, r) for r in records]
        # A rendered chat template holds its special tokens already; a plain prompt gets the tokenizer's.
        answers = [generate_samples(model, tokenizer, [p], s.max_new_tokens or max_new_tokens, device,
                                    special_tokens="prompt" in r)[0] for r, p in zip(records, prompts, strict=True)]
        result = SetResult(s.name)
        for rec, prompt, ans in zip(records, prompts, answers, strict=True):
            scores = score_answer(ans["completion"], rec["reference"], s.metrics, s.extract)
            result.rows.append({"prompt": prompt, "reference": rec["reference"], "answer": ans["completion"],
                                **{f"score/{k}": v for k, v in scores.items()}})
        results.append(result)
    return results
