"""The eval gate on a DPO run's held-out preference accuracy: the champion scored on the same pairs, reused when the
pairs are equal; an undertrained challenger is kept out by the preference rule alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests_support import tiny_overrides

from memfit import config, phases

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _dpo_run(root: Path, store: Path, **extra: object):
    """configs/dpo-tiny.yaml through phases 1-5 (no Prefect), registered as `dpo-tiny` in one SQLite store."""
    base = {"export.onnx": False, "train.num_threads": 1, "train.eval_batches": 8, "tracking.system_metrics": False,
            "eval.prompts": "[Q]", "eval.max_new_tokens": 4, "tracking.uri": f"sqlite:///{store}", **extra}
    cfg = config.load(REPO / "configs" / "dpo-tiny.yaml", tiny_overrides(root, **base))
    probe = phases.check_environment_and_probe(cfg)
    trained = phases.train(cfg, phases.plan_stack(cfg, probe), phases.recover_training_checkpoint(cfg), probe)
    return cfg, phases.evaluate_and_release(cfg, trained)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-gate")
    store = root / "mlflow.db"
    champion = _dpo_run(root / "a", store)
    # The same pairs, a learning rate too small to learn the rule: held-out preference accuracy stays near chance.
    gate = {"eval.gate.metrics": "{preference/accuracy: {min: 0.3, max_drop: 0.2}}", "eval.gate.beat_champion": False,
            "eval.gate.max_perplexity": 1.0e6, "train.lr": 1.0e-7}
    challenger = _dpo_run(root / "b", store, **gate)
    return champion, challenger


def _run_id(client, cfg) -> str:
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"params.`checkpoint.uri` = '{cfg.checkpoint.uri}'")
    return run.info.run_id


def test_a_dpo_champion_is_scored_on_its_held_out_pairs(gated):
    (cfg, report), _ = gated
    from mlflow import MlflowClient

    client = MlflowClient(cfg.tracking.resolved_uri())
    m = client.get_run(_run_id(client, cfg)).data.metrics
    # The rule learnt: the export prefers the chosen answer of nearly every held-out pair, by a clear margin.
    assert m["eval/preference/accuracy"] >= 0.9 and m["eval/preference/margin"] > 0
    assert m["eval/preference/pairs"] >= 50 and m["eval/preference/accuracy_stderr"] >= 0
    # The export, reloaded from disk, ranks the pairs as the last validation in training did (same definition).
    assert abs(m["eval/preference/accuracy"] - m["val_preference_accuracy"]) <= 0.1
    assert report.registry["gate_passed"] and report.registry["version"] == "1"
    assert report.task_scores["eval/preference/accuracy"] == m["eval/preference/accuracy"]


def test_an_undertrained_challenger_fails_the_preference_gate_against_the_champion(gated):
    (_, champion), (cfg, challenger) = gated
    ours = challenger.task_scores["eval/preference/accuracy"]
    theirs = challenger.task_scores["champion/eval/preference/accuracy"]
    assert theirs == champion.task_scores["eval/preference/accuracy"]  # the same pairs: the champion's own figure
    assert 0.25 <= ours <= 0.75 and ours >= 0.3, ours  # near chance, above the min: max_drop is what stops it
    reg = challenger.registry
    assert reg["gate_passed"] is False and reg["version"] is None and reg["previous_champion"] == "1"
    assert reg["gate_reason"] == (f"eval/preference/accuracy {ours:.4f} is {theirs - ours:.4f} below the champion's "
                                  f"{theirs:.4f} (> eval.gate.metrics['preference/accuracy'].max_drop 0.2)")
    from mlflow import MlflowClient

    client = MlflowClient(cfg.tracking.resolved_uri())
    run = client.get_run(_run_id(client, cfg))
    assert run.data.tags["memfit.gate.reason"] == reg["gate_reason"]
    # Same data, same eval settings: the champion's recorded scores were used, not a second scoring.
    assert run.data.tags["memfit.champion_scores"].startswith("recorded by run ")
    assert challenger.final_val_perplexity < 1.0e6


def test_a_preference_gate_on_an_sft_run_is_refused_in_one_line(tmp_path):
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval.gate.metrics: 'preference/accuracy' is scored on held-out "
                                          r"preference pairs, and train.objective is sft"):
        config.load(REPO / "configs" / "tiny.yaml",
                    tiny_overrides(tmp_path, **{"eval.gate.metrics": "{preference/accuracy: {min: 0.5}}"}))
    with pytest.raises(ConfigError, match=r"'preference/acc': a DPO run's held-out pairs give preference/accuracy"):
        config.load(REPO / "configs" / "dpo-tiny.yaml",
                    tiny_overrides(tmp_path, **{"eval.gate.metrics": "{preference/acc: {min: 0.5}}"}))
