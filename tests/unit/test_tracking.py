"""Redaction, the eval gate, the tracker fallback and the review tables: pure functions and fast failures."""

from __future__ import annotations

import logging
import socket

import pytest

from memfit import config
from memfit.errors import TrackingError
from memfit.release.registry import gate
from memfit.tracking import NullTracker, make_tracker, redact, scrub
from memfit.tracking.base import REDACTED, scrub_obj

pytestmark = pytest.mark.unit

HF_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"


def test_redact_masks_secret_keys_but_not_token_counts(monkeypatch):
    monkeypatch.setenv("MEMFIT_TEST_API_TOKEN", "env-secret-value-123")
    out = redact({"export.api_key": "abc", "aws.secret_access_key": "x", "eval.max_new_tokens": 16,
                  "tokens_per_s": 12.5, "model.tokenizer": "gpt2", "empty_token": "",
                  "data.path": "/data/env-secret-value-123/corpus.txt",
                  "tracking.uri": "http://alice:s3cr3t-pass@mlflow.internal:5000",
                  "eval.prompts": ["hello", f"my key is {HF_TOKEN}"]})
    assert out["export.api_key"] == REDACTED and out["aws.secret_access_key"] == REDACTED
    assert out["eval.max_new_tokens"] == 16 and out["tokens_per_s"] == 12.5 and out["model.tokenizer"] == "gpt2"
    assert out["empty_token"] == ""  # nothing to hide: an empty value stays visibly empty
    assert out["data.path"] == f"/data/{REDACTED}/corpus.txt"
    assert out["tracking.uri"] == f"http://alice:{REDACTED}@mlflow.internal:5000"
    assert HF_TOKEN not in out["eval.prompts"] and "hello" in out["eval.prompts"]


@pytest.mark.parametrize("secret", [
    "AKIAIOSFODNN7EXAMPLE", "ghp_" + "a" * 36, "sk-" + "B" * 40, "xoxb-1234567890-abcdef",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----",
])
def test_scrub_self_announcing_tokens(secret):
    text = f"before {secret} after"
    assert scrub(text, {}) == f"before {REDACTED} after"


def test_scrub_env_values_only_when_long_and_named_like_secrets():
    env = {"DB_PASSWORD": "correct-horse-battery", "SHORT_TOKEN": "abc", "HOME": "/root/somewhere-long"}
    text = "pw correct-horse-battery short abc home /root/somewhere-long"
    assert scrub(text, env) == f"pw {REDACTED} short abc home /root/somewhere-long"
    nested = scrub_obj({"a": ["correct-horse-battery"], "password": "x", "n": 3}, env)
    assert nested == {"a": [REDACTED], "password": REDACTED, "n": 3}


def test_environment_report_masks_secrets(monkeypatch):
    from memfit.runtime.env import relevant_environment

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-planted-987")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:pw-planted-654@127.0.0.1:5000")
    monkeypatch.setenv("HF_TOKEN", "hf-token-planted-321")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    env = relevant_environment()
    assert env["AWS_SECRET_ACCESS_KEY"] == REDACTED and env["HF_TOKEN"] == REDACTED
    assert env["MLFLOW_TRACKING_URI"] == f"http://bob:{REDACTED}@127.0.0.1:5000"
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # "tokenizers" is not a token
    text = repr(env)
    for planted in ("aws-secret-planted-987", "pw-planted-654", "hf-token-planted-321"):
        assert planted not in text


class _Gate:
    def __init__(self, max_perplexity=None, beat_champion=True):
        self.max_perplexity, self.beat_champion = max_perplexity, beat_champion


@pytest.mark.parametrize(("metrics", "champion", "cfg", "passed", "words"), [
    ({"val_perplexity": 5.0}, None, _Gate(), True, "no champion yet"),
    ({"val_perplexity": 5.0}, {"val_perplexity": 6.0}, _Gate(), True, "beats the champion's 6.0000"),
    ({"val_perplexity": 6.0}, {"val_perplexity": 6.0}, _Gate(), False, "does not beat the champion's 6.0000"),
    ({"val_perplexity": 7.5}, {"val_perplexity": 6.0}, _Gate(beat_champion=False), True, "no gate configured"),
    ({"val_perplexity": 7.5}, None, _Gate(max_perplexity=7.0), False, "7.5000 > eval.gate.max_perplexity 7"),
    ({"val_perplexity": 6.5}, {"val_perplexity": 6.0}, _Gate(max_perplexity=7.0), False, "does not beat"),
    ({"val_perplexity": 5.5}, {"val_perplexity": 6.0}, _Gate(max_perplexity=7.0), True, "<= eval.gate"),
    ({"val_perplexity": float("nan")}, None, _Gate(), False, "nothing to judge"),
    ({}, None, _Gate(), False, "val_perplexity is None"),
])
def test_gate(metrics, champion, cfg, passed, words):
    result = gate(metrics, champion, cfg)
    assert result.passed is passed and words in result.reason, result.reason


def test_gate_config_is_validated():
    with pytest.raises(Exception, match="eval.gate.max_perplexity"):
        config.load(None, ["eval.gate.max_perplexity=0.5"])
    with pytest.raises(Exception, match="registry.alias"):
        config.load(None, ["registry.alias=has space"])
    cfg = config.load(None, ["eval.gate.max_perplexity=20", "registry.model_name=mine"])
    assert cfg.eval.gate.max_perplexity == 20 and cfg.eval.gate.beat_champion is True
    assert cfg.registry.model_name == "mine" and cfg.tracking.fail_if_unreachable is True


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_early_naming_the_uri_without_its_password():
    uri = f"http://user:hunter2-planted@127.0.0.1:{_closed_port()}"
    cfg = config.load(None, [f"tracking.uri={uri}"])
    with pytest.raises(TrackingError) as err:
        make_tracker(cfg.tracking)
    msg = str(err.value)
    assert "127.0.0.1" in msg and "unreachable" in msg and "tracking.fail_if_unreachable=false" in msg
    assert "hunter2-planted" not in msg


def test_optional_tracking_warns_and_falls_back_to_null(caplog):
    uri = f"http://127.0.0.1:{_closed_port()}"
    cfg = config.load(None, [f"tracking.uri={uri}", "tracking.fail_if_unreachable=false"])
    with caplog.at_level(logging.WARNING, logger="memfit.tracking"):
        tracker = make_tracker(cfg.tracking)
    assert isinstance(tracker, NullTracker)
    assert any(uri in r.getMessage() and "WITHOUT tracking" in r.getMessage() for r in caplog.records)


def test_sqlite_store_in_a_missing_folder_is_named(tmp_path):
    uri = f"sqlite:///{tmp_path / 'nope' / 'mlflow.db'}"
    with pytest.raises(TrackingError, match="nope"):
        make_tracker(config.load(None, [f"tracking.uri={uri}"]).tracking)


def test_plan_table_lists_plan_and_probe():
    from memfit.run_context import plan_table

    md = plan_table({"policy": "full", "precision": "fp32", "reason": "over budget"},
                    {"peak_bytes": 2e9, "budget_bytes": 1e9, "fits": False, "breakdown": {"activation": 1.5e9}})
    assert "| policy | full |" in md and "Why: over budget" in md
    assert "| peak | 2.0000 GB |" in md and "| activation | 1.5000 GB |" in md and "| fits | False |" in md


def test_preflight_checks_the_tracking_server_before_any_work(tmp_path, caplog):
    from memfit.preflight import preflight

    uri = f"http://127.0.0.1:{_closed_port()}"
    outputs = [f"run.work_dir={tmp_path / 'w'}", f"export.dir={tmp_path / 'e'}", f"checkpoint.uri={tmp_path / 'c'}",
               f"tracking.uri={uri}"]
    with pytest.raises(TrackingError, match=f"tracking.uri {uri}: MLflow server unreachable"):
        preflight(config.load(None, outputs))
    with caplog.at_level(logging.WARNING, logger="memfit.tracking"):
        preflight(config.load(None, [*outputs, "tracking.fail_if_unreachable=false"]))
    assert any("WITHOUT tracking" in r.getMessage() for r in caplog.records)


def test_a_run_missing_from_this_store_goes_on_in_a_new_tagged_run(tmp_path, caplog):
    """A spot restart on a new machine: the checkpoint names a run its local store never saw."""
    from memfit.tracking.mlflow_tracker import MLflowTracker

    first = MLflowTracker(f"sqlite:///{tmp_path / 'machine-a.db'}", "memfit")
    old_id = first.start_run("tiny")
    first.end_run("KILLED")
    second = MLflowTracker(f"sqlite:///{tmp_path / 'machine-b.db'}", "memfit")
    with caplog.at_level(logging.WARNING, logger="memfit"):
        new_id = second.start_run("tiny", run_id=old_id, tags={"memfit.host": "b"})
    assert new_id != old_id and not second.continued
    tags = second.client.get_run(new_id).data.tags
    assert tags["memfit.resumed_from_run_id"] == old_id and tags["memfit.host"] == "b"
    assert "shared tracking server" in caplog.text and old_id in caplog.text
    second.end_run("FINISHED")
    # In the store that holds it, the same id is reopened, not replaced.
    again = MLflowTracker(f"sqlite:///{tmp_path / 'machine-a.db'}", "memfit")
    assert again.start_run("tiny", run_id=old_id) == old_id and again.continued
    again.end_run("FINISHED")


def test_missing_run_error_policy_names_the_setting(tmp_path):
    from memfit.tracking.mlflow_tracker import MLflowTracker

    tracker = MLflowTracker(f"sqlite:///{tmp_path / 'b.db'}", "memfit", missing_run="error")
    with pytest.raises(TrackingError, match="tracking.missing_run=new_run") as err:
        tracker.start_run("tiny", run_id="0123456789abcdef0123456789abcdef")
    assert "\n" not in str(err.value)
