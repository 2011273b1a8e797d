"""Chat and instruction data trained for real: prompt/completion parquet, padding-free resume, `memfit run` on chats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_support import messages_jsonl, prompt_completion_parquet
from safetensors.torch import load_file
from shipped_templates import SHIPPED
from tests_support import tiny_overrides

from memfit import config, phases
from memfit.reports import PlanReport

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "configs" / "chat.yaml"


def _config(root: Path, **extra: object):
    base = {"train.max_steps": 8, "checkpoint.every_steps": 3, "train.warmup_steps": 2, "export.onnx": False,
            "tracking.backend": "null", "train.num_threads": 1, "train.eval_batches": 2}
    return config.load(CHAT, tiny_overrides(root, None, **{**base, **extra}))


def _train(cfg):
    # A fixed plan (no probe, no planner): these tests pin the data path, not the memory plan.
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description="none")
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None)


def _final_weights(ckpt_root: Path) -> dict[str, torch.Tensor]:
    newest = sorted(p for p in ckpt_root.iterdir() if p.name.startswith("step-"))[-1]
    return load_file(str(newest / "model.safetensors"))


def test_prompt_completion_parquet_trains_on_completions(tmp_path):
    data = prompt_completion_parquet(tmp_path / "pairs.parquet", 300)
    cfg = _config(tmp_path, **{"data.path": str(data), "data.format": "auto", "data.train_on": "completion",
                               "data.seq_len": 64, "train.max_steps": 25, "checkpoint.every_steps": 25})
    result = _train(cfg)
    assert result.steps == 25
    # Loss on the answers only falls well below where it started (a random model: ~ln(vocab) = 5.9).
    assert result.final_train_loss < result.initial_val_loss - 1.5, (result.initial_val_loss,
                                                                     result.final_train_loss)


@pytest.mark.parametrize("packing,flatten", [("padding_free", False), ("padding_free", True), ("none", False)])
def test_padding_free_run_killed_after_a_checkpoint_resumes_bitwise(tmp_path, monkeypatch, packing, flatten):
    # none: one example a row in the length-grouped order, which a resumed run must continue exactly too.
    data = messages_jsonl(tmp_path / "chat.jsonl", 120)
    common = {"data.path": str(data), "data.seq_len": 96, "data.flatten": flatten, "data.packing": packing}
    _train(_config(tmp_path, **common, **{"checkpoint.uri": str(tmp_path / "straight")}))

    cfg = _config(tmp_path, **common, **{"checkpoint.uri": str(tmp_path / "killed")})
    # The process dies right after step 7 (a crash, not a graceful stop): only the step-6 checkpoint survives.
    monkeypatch.setenv("MEMFIT_TEST_RANK_FAULT", "crash:0:7")
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(cfg)
    monkeypatch.delenv("MEMFIT_TEST_RANK_FAULT")
    resume = phases.recover_training_checkpoint(cfg)
    assert resume.step == 6 and not resume.finished
    result = _train(cfg)
    assert result.resumed_from == 6 and result.steps == 8
    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"


def test_packing_auto_trains_with_the_layout_predicted_fastest_and_says_why(tmp_path, caplog):
    import logging

    data = messages_jsonl(tmp_path / "chat.jsonl", 120)
    cfg = _config(tmp_path, **{"data.path": str(data), "data.seq_len": 96, "data.packing": "auto",
                               "train.max_steps": 3, "checkpoint.every_steps": 3})
    with caplog.at_level(logging.INFO, logger="memfit.data"):
        result = _train(cfg)
    assert result.steps == 3 and result.padding_fraction is not None
    (layout,) = (tmp_path / "work" / "data-cache").glob("layout-*.json")  # resolved once, reused by every phase
    saved = json.loads(layout.read_text())
    rows = {r["packing"]: r for r in saved["candidates"]}
    assert set(rows) == {"none", "padding_free"} and saved["device"] == "cpu"  # chats: blocks would mix them
    assert saved["packing"] == min(rows.values(), key=lambda r: r["seconds"] / r["trained"])["packing"]
    assert f"data.packing auto: {saved['packing']} on cpu" in caplog.text


def test_own_chatml_template_without_markers_trains_exactly_what_markers_train(tmp_path, caplog):
    """SmolLM2's template as shipped (answers found turn by turn) against the same with generation markers."""
    data = messages_jsonl(tmp_path / "chat.jsonl", 120)
    shipped, marked, _, _ = SHIPPED["smollm2-chatml"]
    results, weights = [], []
    for name, template in (("shipped", shipped), ("marked", marked)):
        (tmp_path / f"{name}.jinja").write_text(template)
        caplog.clear()
        with caplog.at_level("INFO", logger="memfit.data"):
            results.append(_train(_config(tmp_path, **{
                "data.path": str(data), "data.seq_len": 128, "data.chat_template": str(tmp_path / f"{name}.jinja"),
                "checkpoint.uri": str(tmp_path / name), "train.max_steps": 10, "checkpoint.every_steps": 10})))
        share = float(caplog.text.split("trained tokens (train_on assistant): ")[1].split("%")[0]) / 100
        assert 0.05 < share < 0.6, share  # the answers, not the prompts, system turns or headers
        weights.append(_final_weights(tmp_path / name))
    a, b = results
    assert a.final_train_loss < a.initial_val_loss - 0.5, (a.initial_val_loss, a.final_train_loss)
    # Same labels, token by token, so the same run: equal losses and equal weights.
    assert (a.initial_val_loss, a.final_train_loss) == (b.initial_val_loss, b.final_train_loss)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, prefect_home_template):
    """`memfit run configs/chat.yaml` on a generated messages .jsonl, as a user types it (a real process)."""
    root = tmp_path_factory.mktemp("chat-run")
    data = messages_jsonl(root / "conversations.jsonl", 400, seed=3)
    sets = tiny_overrides(root, None, **{"data.path": str(data), "train.max_steps": 40, "checkpoint.every_steps": 20,
                                         "export.onnx": False, "data.heldout_prompts": 3})
    args = [a for s in sets for a in ("--set", s)]
    shutil.copytree(prefect_home_template, root / "prefect")  # migrated once per session
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(root / "prefect")}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "run", str(CHAT), "--json", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout + proc.stderr, root


@pytest.mark.slow
def test_chat_run_logs_the_trained_share_and_validation_on_answers_falls(chat_run):
    from mlflow import MlflowClient

    out, log, _ = chat_run
    assert "trained tokens (train_on assistant):" in log
    share = float(log.split("trained tokens (train_on assistant): ")[1].split("%")[0]) / 100
    assert 0.1 < share < 0.6  # answers are a minority of a conversation's tokens
    run = MlflowClient(out["tracking_uri"]).get_run(out["mlflow_run_id"])
    assert float(run.data.params["data.trained_tokens_share"]) == pytest.approx(share, abs=1e-3)
    assert run.data.metrics["trained_tokens_share"] == pytest.approx(share, abs=1e-3)
    assert run.data.params["data.packing"] == "padding_free" and run.data.params["data.train_on"] == "assistant"
    # Validation loss counts assistant tokens only, and it falls.
    assert out["final_val_loss"] < out["initial_val_loss"] - 1.0, (out["initial_val_loss"], out["final_val_loss"])


@pytest.mark.slow
def test_chat_run_counts_real_and_trained_tokens_not_padding(chat_run):
    from mlflow import MlflowClient

    out, _, _ = chat_run
    client = MlflowClient(out["tracking_uri"])
    run = client.get_run(out["mlflow_run_id"])
    slots = int(run.data.params["train.batch_size"]) * int(run.data.params["data.seq_len"])
    hist = {k: {m.step: m.value for m in client.get_metric_history(out["mlflow_run_id"], k)}
            for k in ("tokens_per_s", "trained_tokens_per_s", "padding_fraction", "step_time_s")}
    assert hist["padding_fraction"] and set(hist["padding_fraction"]) == set(hist["tokens_per_s"])
    for step, padding in hist["padding_fraction"].items():
        real = hist["tokens_per_s"][step] * hist["step_time_s"][step]
        trained = hist["trained_tokens_per_s"][step] * hist["step_time_s"][step]
        assert 0.0 < padding < 0.5 and real == pytest.approx(slots * (1 - padding), rel=1e-6)
        assert real == pytest.approx(round(real), abs=1e-3) and 0 < trained < real  # whole tokens, answers fewer


@pytest.mark.slow
def test_chat_run_logs_heldout_answers_beside_references(chat_run):
    from mlflow import MlflowClient

    out, _, root = chat_run
    client = MlflowClient(out["tracking_uri"])
    table = json.loads(Path(client.download_artifacts(out["mlflow_run_id"], "eval/heldout_generations.json",
                                                      str(root))).read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert len(rows) == 3
    assert all(r["prompt"].rstrip().endswith("<|assistant|>") and r["reference"] for r in rows)


@pytest.mark.slow
def test_chat_export_renders_its_template_and_answers_through_a_pipeline(chat_run):
    from transformers import AutoTokenizer
    from transformers import pipeline as hf_pipeline

    out, _, _ = chat_run
    folder = out["safetensors_dir"]
    tok = AutoTokenizer.from_pretrained(folder)
    question = [{"role": "user", "content": "what is 2 plus 3?"}]
    assert tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True) == \
        "<|user|>\nwhat is 2 plus 3?\n<|assistant|>\n"
    generator = hf_pipeline("text-generation", model=folder, tokenizer=folder, device="cpu")
    reply = generator(question, max_new_tokens=10, do_sample=False)[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"].strip()
    # The pipeline answered the template-rendered prompt: the same greedy tokens as generating from it by hand.
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model = generator.model
    ids = model.generate(**prompt, max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
    by_hand = tok.decode(ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply["content"] == by_hand


@pytest.mark.slow
def test_chat_model_in_mlflow_answers_messages(chat_run):
    import mlflow
    import pandas as pd
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    out, _, _ = chat_run
    assert out["registered_model"] == "chat@champion"
    with _use_tracking_uri(out["tracking_uri"]):
        model = mlflow.pyfunc.load_model("models:/chat@champion")
    frame = pd.DataFrame({"messages": [[{"role": "user", "content": "what is 2 plus 3?"}]], "prompt": [None]})
    [answer] = model.predict(frame, params={"max_new_tokens": 10})
    # Messages in, the exported template applied: the answer transformers' pipeline gives to the same question.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out["safetensors_dir"]
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    ids = AutoModelForCausalLM.from_pretrained(folder).eval().generate(**prompt, max_new_tokens=10, do_sample=False,
                                                                       pad_token_id=tok.eos_token_id)
    assert answer == tok.decode(ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True) and answer.strip()
    # Plain prompts still work, alone (the signature's old shape) and beside conversations.
    assert len(model.predict(pd.DataFrame({"prompt": ["what is"]}), params={"max_new_tokens": 3})) == 1
    mixed = pd.DataFrame({"prompt": ["what is", None], "messages": [None, [{"role": "user", "content": "hi"}]]})
    assert [type(a) for a in model.predict(mixed, params={"max_new_tokens": 3})] == [str, str]


@pytest.mark.parametrize("records, needles", [
    ([{"messages": [{"role": "user", "content": "hi"}]}, {"text": "not a chat"}], ["record 2", "'messages'"]),
    ([{"messages": []}], ["record 1", "empty conversation"]),
], ids=["no-field", "empty-conversation"])
def test_run_refuses_bad_records_in_one_line_before_prefect_starts(tmp_path, records, needles):
    from memfit.data.synthetic import write_jsonl

    data = write_jsonl(records, tmp_path / "chats.jsonl")
    sets = [a for s in tiny_overrides(tmp_path, None, **{"data.path": str(data)}) for a in ("--set", s)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "run", str(CHAT), *sets], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: data.messages_field: ") and "chats.jsonl" in last, last
    for needle in needles:
        assert needle in last, last
    assert not (tmp_path / "prefect").exists()  # refused before any Prefect server or database
