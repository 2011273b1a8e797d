"""Benchmark tasks in phase 5: local lm-evaluation-harness tasks (multiple choice and generation) scored on the
export, in MLflow with standard errors and per-sample records, read by the gate; bad task input stops before
training with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_support import REPO, train_champion

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PAIRS = [("the", "dog"), ("cat", "ran"), ("sat", "to"), ("on", "the"), ("a", "end"), ("mat", "of"), ("by", "a"),
         ("the", "long"), ("door", "road"), ("and", "one")]


def write_tasks(folder) -> None:
    """A multiple-choice task (log-likelihoods) and a generation task (exact match), as local YAML + JSONL."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = [{"question": f"{a} {b}", "choices": [f" {c}" for c in (a, b, "sat", "the")], "answer": i % 4}
          for i, (a, b) in enumerate(PAIRS)]
    gen = [{"prompt": f"{a} {b}", "answer": a} for a, b in PAIRS]
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
    (folder / "memfit_mc.yaml").write_text(
        f"task: memfit_mc\n{head}    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "memfit_gen.yaml").write_text(
        f"task: memfit_gen\n{head}    test: {folder / 'gen.jsonl'}\noutput_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def write_set(folder) -> None:
    """An own eval set: plain prompts and one conversation (answered with the chat template)."""
    rows = [{"prompt": f"{a} {b}", "reference": a} for a, b in PAIRS[:5]]
    rows.append({"messages": [{"role": "user", "content": "one two"}], "reference": "three"})
    (folder / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _eval_overrides(root, tasks_root, **gate) -> dict:
    sets = f"[{{name: answers, path: {tasks_root / 'answers.jsonl'}, metrics: [exact_match, contains, rouge_l]}}]"
    return {"eval.tasks": "[memfit_mc, memfit_gen]", "eval.task_paths": f"[{tasks_root}]", "eval.sets": sets,
            "eval.gate.beat_champion": False, "export.onnx": False, **gate}


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A champion (v1: tasks and sets, no rule on them), then a challenger gated on a task score it cannot reach,
    judged beside the champion on the same data; both in one MLflow store."""
    root = tmp_path_factory.mktemp("eval-tasks")
    write_tasks(root / "tasks")
    write_set(root / "tasks")
    champion = train_champion(root / "a", steps=6, onnx=False, **_eval_overrides(root, root / "tasks"),
                              **{"tracking.uri": f"sqlite:///{root / 'mlflow.db'}"})
    challenger = train_champion(root / "b", steps=6, onnx=False, **{"tracking.uri": f"sqlite:///{root / 'mlflow.db'}"},
                                **_eval_overrides(root, root / "tasks",
                                                  **{"eval.gate.metrics": "{memfit_mc/acc: {min: 1.01}}"}))
    return champion, challenger


def _run(cfg, report):
    """The run of `cfg` (both runs are named tiny: told apart by their checkpoint store, a logged param)."""
    from mlflow import MlflowClient

    client = MlflowClient(cfg.tracking.resolved_uri())
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"params.`checkpoint.uri` = '{cfg.checkpoint.uri}'")
    return client, run


def test_task_and_set_scores_reach_mlflow_with_standard_errors_and_samples(scored):
    (cfg, report), _ = scored
    assert report.registry["gate_passed"] and report.registry["version"] == "1"
    client, run = _run(cfg, report)
    m = run.data.metrics
    assert 0.0 <= m["eval/memfit_mc/acc"] <= 1.0 and m["eval/memfit_mc/acc_stderr"] > 0.0
    assert 0.0 <= m["eval/memfit_gen/exact_match"] <= 1.0 and "eval/memfit_gen/exact_match_stderr" in m
    assert m["eval_seconds/memfit_mc"] > 0 and m["eval_seconds/memfit_gen"] > 0 and m["eval_seconds/sets"] > 0
    assert report.task_scores["eval/memfit_mc/acc"] == m["eval/memfit_mc/acc"]
    assert m["eval/answers/examples"] == 6
    assert {f"eval/answers/{k}" for k in ("exact_match", "contains", "rouge_l")} <= set(m)
    names = {a.path for a in client.list_artifacts(run.info.run_id, "eval/tasks")}
    assert names == {"eval/tasks/memfit_mc.jsonl", "eval/tasks/memfit_gen.jsonl"}
    local = client.download_artifacts(run.info.run_id, "eval/tasks/memfit_mc.jsonl")
    rows = [json.loads(line) for line in Path(local).read_text().splitlines()]
    assert len(rows) == len(PAIRS) and all(len(r["filtered_resps"]) == 4 for r in rows)  # 4 choices each
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/sets/answers.json")).read_text())
    answers = dict(zip(table["columns"], zip(*table["data"], strict=True), strict=True))
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(report.safetensors_dir).apply_chat_template(
        [{"role": "user", "content": "one two"}], tokenize=False, add_generation_prompt=True)
    assert answers["reference"][-1] == "three" and answers["prompt"][-1] == rendered  # the model's chat template
    scores = answers["score/contains"]
    assert m["eval/answers/contains"] == pytest.approx(sum(scores) / len(scores))


def test_the_champion_is_judged_beside_the_challenger_and_the_gate_names_the_metric(scored):
    (cfg_a, champion), (cfg_b, challenger) = scored
    client, run_a = _run(cfg_a, champion)
    _, run_b = _run(cfg_b, challenger)
    # The champion, fetched from the registry and judged again on the same data, scores what it scored as a run.
    for key in ("eval/memfit_mc/acc", "eval/memfit_gen/exact_match", "eval/answers/rouge_l"):
        assert run_b.data.metrics[f"champion/{key}"] == pytest.approx(run_a.data.metrics[key], abs=1e-9)
    mine = json.loads(Path(client.download_artifacts(run_a.info.run_id, "eval/sets/answers.json")).read_text())
    side = json.loads(Path(client.download_artifacts(run_b.info.run_id, "eval/compare/answers.json")).read_text())
    cols = dict(zip(side["columns"], zip(*side["data"], strict=True), strict=True))
    assert list(cols["champion"]) == [row[mine["columns"].index("answer")] for row in mine["data"]]
    assert {"challenger", "champion_rouge_l", "challenger_rouge_l", "reference"} <= set(cols)
    reg = challenger.registry
    acc = challenger.task_scores["eval/memfit_mc/acc"]
    assert reg["gate_passed"] is False and reg["version"] is None and reg["previous_champion"] == "1"
    assert reg["gate_reason"] == f"eval/memfit_mc/acc {acc:.4f} < eval.gate.metrics['memfit_mc/acc'].min 1.01"


def test_gate_rules_against_the_champion_name_both_values():
    from types import SimpleNamespace

    from memfit.release.registry import gate

    rules = SimpleNamespace(max_perplexity=None, beat_champion=False,
                            metrics={"mc/acc": {"min": None, "max_drop": 0.02}})
    ours = {"val_perplexity": 5.0, "eval/mc/acc": 0.50}
    assert gate(ours, {"eval/mc/acc": 0.51}, rules).passed
    failed = gate(ours, {"eval/mc/acc": 0.60}, rules)
    assert not failed.passed and failed.reason == ("eval/mc/acc 0.5000 is 0.1000 below the champion's 0.6000 "
                                                   "(> eval.gate.metrics['mc/acc'].max_drop 0.02)")
    assert "max_drop not applied" in gate(ours, {}, rules).reason
    missing = gate({"val_perplexity": 5.0, "eval/mc/acc_norm": 0.4}, None, rules)
    assert not missing.passed and "no task produced it (produced: eval/mc/acc_norm)" in missing.reason


def test_bad_task_input_is_one_line_before_training(tmp_path):
    from tests_support import tiny_overrides

    from memfit import config
    from memfit.errors import ConfigError
    from memfit.preflight import preflight

    write_tasks(tmp_path / "tasks")
    base = {"eval.task_paths": f"[{tmp_path / 'tasks'}]"}

    def load(**extra):
        return config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path, **{**base, **extra}))

    with pytest.raises(ConfigError, match="no lm-evaluation-harness task named 'memfit_nope'"):
        preflight(load(**{"eval.tasks": "[memfit_nope]"}))
    (tmp_path / "tasks" / "gen.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"task 'memfit_gen' reads .*gen.jsonl, which does not exist"):
        preflight(load(**{"eval.tasks": "[memfit_mc, memfit_gen]"}))
    with pytest.raises(ConfigError, match="names 'other', which neither eval.tasks nor eval.sets runs"):
        load(**{"eval.tasks": "[memfit_mc]", "eval.gate.metrics": "{other/acc: {min: 0.5}}"})
    (tmp_path / "tasks" / "bad.jsonl").write_text('{"prompt": "x", "reference": "y"}\n{"prompt": "no answer"}\n')
    with pytest.raises(ConfigError, match=r"eval.sets\['mine'\]: .*bad.jsonl line 2 has no reference"):
        preflight(load(**{"eval.sets": f"[{{name: mine, path: {tmp_path / 'tasks' / 'bad.jsonl'}}}]"}))
