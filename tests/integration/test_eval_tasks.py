"""Benchmark tasks in phase 5: local lm-evaluation-harness tasks (multiple choice and generation) scored on the
export, in MLflow with standard errors and per-sample records, read by the gate; bad task input stops before
training with one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from serve_support import REPO, train_champion

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WORDS = ["red", "blue", "green", "gold", "pink", "gray", "black", "white", "brown", "cyan", "lime", "navy"]
RULE = {w: WORDS[(i * 5 + 3) % len(WORDS)] for i, w in enumerate(WORDS)}  # the answer to "a b c ->" is RULE[c]


def _question(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(3)]
    return " ".join(words) + " ->", RULE[words[-1]]


def write_training_data(folder, n: int = 600) -> None:
    """rule.jsonl: answers that follow RULE (learnable); shuffled.jsonl: the same prompts, answers at random."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, shuffled in (("rule", False), ("shuffled", True)):
        rng = random.Random(1)
        rows = []
        for _ in range(n):
            prompt, answer = _question(rng)
            rows.append({"prompt": prompt, "completion": " " + (rng.choice(WORDS) if shuffled else answer)})
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_tasks(folder, n: int = 12) -> None:
    """A multiple-choice task (log-likelihoods) and a generation task (exact match) on RULE, local YAML + JSONL."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    mc, gen = [], []
    for i in range(n):
        prompt, answer = _question(rng)
        wrong = rng.sample([w for w in WORDS if w != answer], 3)
        choices = wrong[:i % 4] + [answer] + wrong[i % 4:]
        mc.append({"question": prompt, "choices": choices, "answer": i % 4})  # the harness puts " " between
        gen.append({"prompt": prompt, "answer": answer})
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
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 2\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "    regexes_to_ignore: ['^ ', ' .*$']\n")  # the answer is the first word generated


def write_set(folder) -> None:
    """An own eval set: prompts on RULE and one conversation (answered with the chat template)."""
    rng = random.Random(11)
    rows = [dict(zip(("prompt", "reference"), _question(rng), strict=True)) for _ in range(5)]
    rows.append({"messages": [{"role": "user", "content": "red blue ->"}], "reference": RULE["blue"]})
    (folder / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _eval_overrides(root, tasks_root, **gate) -> dict:
    sets = f"[{{name: answers, path: {tasks_root / 'answers.jsonl'}, metrics: [exact_match, contains, rouge_l]}}]"
    return {"eval.tasks": "[memfit_mc, memfit_gen]", "eval.task_paths": f"[{tasks_root}]", "eval.sets": sets,
            "eval.gate.beat_champion": False, "export.onnx": False, "data.format": "prompt_completion",
            "data.train_on": "completion", "data.packing": "none", "data.seq_len": 16, "train.batch_size": 16,
            "train.grad_accum_steps": 1, "tracking.uri": f"sqlite:///{root / 'mlflow.db'}", **gate}


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A champion trained on answers that follow a rule (v1: tasks and sets, no rule on them), then a challenger
    trained on the same prompts with shuffled answers, gated on the task score against the champion's and on a
    perplexity bound it passes; both in one MLflow store."""
    root = tmp_path_factory.mktemp("eval-tasks")
    write_training_data(root / "data")
    write_tasks(root / "tasks")
    write_set(root / "tasks")
    champion = train_champion(root / "a", steps=80, onnx=False, **_eval_overrides(root, root / "tasks"),
                              **{"data.path": str(root / "data" / "rule.jsonl")})
    gate = {"eval.gate.metrics": "{memfit_mc/acc: {max_drop: 0.2}}", "eval.gate.max_perplexity": 100.0}
    challenger = train_champion(root / "b", steps=80, onnx=False, **_eval_overrides(root, root / "tasks", **gate),
                                **{"data.path": str(root / "data" / "shuffled.jsonl")})
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
    assert 0.0 <= m["eval/memfit_mc/acc"] <= 1.0 and m["eval/memfit_mc/acc_stderr"] >= 0.0  # 0 at acc 1.0
    assert 0.0 <= m["eval/memfit_gen/exact_match"] <= 1.0 and "eval/memfit_gen/exact_match_stderr" in m
    assert m["eval_seconds/memfit_mc"] > 0 and m["eval_seconds/memfit_gen"] > 0 and m["eval_seconds/sets"] > 0
    assert report.task_scores["eval/memfit_mc/acc"] == m["eval/memfit_mc/acc"]
    assert m["eval/answers/examples"] == 6
    assert {f"eval/answers/{k}" for k in ("exact_match", "contains", "rouge_l")} <= set(m)
    names = {a.path for a in client.list_artifacts(run.info.run_id, "eval/tasks")}
    assert names == {"eval/tasks/memfit_mc.jsonl", "eval/tasks/memfit_gen.jsonl"}
    local = client.download_artifacts(run.info.run_id, "eval/tasks/memfit_mc.jsonl")
    rows = [json.loads(line) for line in Path(local).read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["filtered_resps"]) == 4 for r in rows)  # 4 choices each
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/sets/answers.json")).read_text())
    answers = dict(zip(table["columns"], zip(*table["data"], strict=True), strict=True))
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(report.safetensors_dir).apply_chat_template(
        [{"role": "user", "content": "red blue ->"}], tokenize=False, add_generation_prompt=True)
    assert answers["reference"][-1] == RULE["blue"] and answers["prompt"][-1] == rendered  # the model's template
    scores = answers["score/contains"]
    assert m["eval/answers/contains"] == pytest.approx(sum(scores) / len(scores))


def test_a_challenger_trained_on_shuffled_answers_fails_the_task_gate_though_its_perplexity_passes(scored):
    (cfg_a, champion), (cfg_b, challenger) = scored
    ours, theirs = challenger.task_scores["eval/memfit_mc/acc"], champion.task_scores["eval/memfit_mc/acc"]
    assert theirs >= 0.75 and ours <= theirs - 0.3, (theirs, ours)  # learnt the rule vs near chance (0.25)
    assert challenger.final_val_perplexity < 100.0  # the perplexity rule alone would have let it through
    reg = challenger.registry
    assert reg["gate_passed"] is False and reg["version"] is None and reg["previous_champion"] == "1"
    assert reg["gate_reason"] == (f"eval/memfit_mc/acc {ours:.4f} is {theirs - ours:.4f} below the champion's "
                                  f"{theirs:.4f} (> eval.gate.metrics['memfit_mc/acc'].max_drop 0.2)")
    from mlflow import MlflowClient

    uri = cfg_b.tracking.resolved_uri()
    assert str(MlflowClient(uri, registry_uri=uri).get_model_version_by_alias("tiny", "champion").version) == "1"
    _, run_b = _run(cfg_b, challenger)
    assert run_b.data.tags["memfit.gate.reason"] == reg["gate_reason"]
    # The harness's standard error of a mean over the 12 questions: sqrt(p (1 - p) / (n - 1)).
    assert run_b.data.metrics["eval/memfit_mc/acc_stderr"] == pytest.approx((ours * (1 - ours) / 11) ** 0.5, rel=1e-6)


def test_the_champion_is_judged_beside_the_challenger_from_its_recorded_scores(scored):
    """Same tasks and sets (equal eval keys): the champion's scores and answers come from its own run, not a second
    evaluation; a changed set file changes the key, so the champion would be judged again."""
    (cfg_a, champion), (cfg_b, challenger) = scored
    client, run_a = _run(cfg_a, champion)
    _, run_b = _run(cfg_b, challenger)
    for key in ("eval/memfit_mc/acc", "eval/memfit_gen/exact_match", "eval/answers/rouge_l"):
        assert run_b.data.metrics[f"champion/{key}"] == run_a.data.metrics[key]
    assert run_b.data.tags["memfit.eval_key"] == run_a.data.tags["memfit.eval_key"]
    assert run_b.data.tags["memfit.champion_scores"] == f"recorded by run {run_a.info.run_id}"
    mine = json.loads(Path(client.download_artifacts(run_a.info.run_id, "eval/sets/answers.json")).read_text())
    side = json.loads(Path(client.download_artifacts(run_b.info.run_id, "eval/compare/answers.json")).read_text())
    cols = dict(zip(side["columns"], zip(*side["data"], strict=True), strict=True))
    assert list(cols["champion"]) == [row[mine["columns"].index("answer")] for row in mine["data"]]
    assert {"challenger", "champion_rouge_l", "challenger_rouge_l", "reference"} <= set(cols)

    from memfit.evaluation.judge import current, eval_key, recorded_scores

    champ = current(cfg_b, run_b.info.run_id)
    assert champ.version == "1" and recorded_scores(cfg_b, champ, eval_key(cfg_b.eval)) is not None
    answers = Path(cfg_b.eval.sets[0].path)
    before = eval_key(cfg_b.eval)
    answers.write_text(answers.read_text() + json.dumps({"prompt": "red red ->", "reference": RULE["red"]}) + "\n")
    assert eval_key(cfg_b.eval) != before
    assert recorded_scores(cfg_b, champ, eval_key(cfg_b.eval)) is None  # judged again on the new set


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
