"""memfit serve-model over a real tiny champion (trained once, registered in a SQLite MLflow store), spoken to with
the `openai` client on 127.0.0.1: completions, chat, streaming, bad input, the ONNX backend, the alias moving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_support import altered_export, corrupted_export, register_version, train_champion

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    """(config, export report) of the tiny champion: version 1 of `tiny`, alias champion, SafeTensors + ONNX."""
    root = tmp_path_factory.mktemp("serve")
    return train_champion(root, steps=8, onnx=True, **{"serve.poll_seconds": 0.5})


@pytest.fixture(scope="module")
def server(champion):
    from memfit.server.run import start_in_thread

    cfg, _ = champion
    running = start_in_thread(cfg, port=0)  # MODEL unset: models:/tiny@champion
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_and_chat_through_the_openai_client(server, client):
    assert server.url.startswith("http://127.0.0.1:")
    out = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
    assert out.model == "tiny/v1"
    assert out.choices[0].text.strip() and out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens >= 1
    again = client.completions.create(model="tiny@champion", prompt="the cat", max_tokens=8, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy: the same text

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                          max_tokens=6, temperature=0)
    assert chat.model == "tiny/v1" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 2  # the chat template's role tags are in the prompt
    assert [m.id for m in client.models.list().data][0] == "tiny/v1"


def test_streaming_gives_the_same_text_piece_by_piece(client):
    whole = client.completions.create(model="tiny", prompt="one two three", max_tokens=12, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="one two three", max_tokens=12, temperature=0, stream=True)]
    assert "".join(pieces) == whole.choices[0].text and len([p for p in pieces if p]) > 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0, stream=True)
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason
    assert all(c.model == "tiny/v1" for c in chunks)


def test_bad_requests_are_4xx_with_a_message_and_the_server_keeps_serving(server, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="beyond the model's context of 512 tokens"):
        client.completions.create(model="tiny", prompt="the cat", max_tokens=511)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'memfit_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    assert "memfit_request_seconds_bucket" in metrics and 'memfit_tokens_total{kind="completion"}' in metrics


def test_a_model_without_chat_template_answers_chat_with_400(champion, tmp_path):
    import shutil

    from memfit.server.run import start_in_thread

    cfg, report = champion
    export = tmp_path / "export"
    shutil.copytree(report.safetensors_dir, export / "hf")
    tok = export / "hf" / "tokenizer_config.json"
    doc = json.loads(tok.read_text())
    doc.pop("chat_template", None)
    tok.write_text(json.dumps(doc))
    (export / "hf" / "chat_template.jinja").unlink(missing_ok=True)
    _rehash(export / "hf")
    running = start_in_thread(cfg, str(export), port=0)
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions",
                       json={"model": "export", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = httpx.post(f"{running.url}/v1/completions", json={"model": "export", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        running.stop()


def _rehash(hf):
    # The export record must describe the edited folder, as a re-export would.
    from memfit.release.formats import MANIFEST_NAME, sha256_file

    manifest = json.loads((hf / MANIFEST_NAME).read_text())
    manifest["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                         for p in sorted(hf.iterdir()) if p.name != MANIFEST_NAME}
    (hf / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_both_backends_serve_the_same_greedy_text(champion, server, client):
    from memfit.server.run import start_in_thread

    cfg, report = champion
    assert httpx.get(f"{server.url}/health").json()["backend"] == "onnx"  # auto on CPU, the export has ONNX
    hf_cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"backend": "transformers"})})
    running = start_in_thread(hf_cfg, str(report.onnx_path).rsplit("/", 1)[0], port=0)
    try:
        assert httpx.get(f"{running.url}/health").json()["backend"] == "transformers"
        body = {"model": "export", "prompt": "the cat", "max_tokens": 10, "temperature": 0}
        got = httpx.post(f"{running.url}/v1/completions", json=body).json()["choices"][0]["text"]
        want = client.completions.create(**{**body, "model": "tiny"}).choices[0].text
        assert got == want
    finally:
        running.stop()


def test_start_up_errors_are_one_line(champion, server):
    from memfit.errors import ConfigError, ModelLoadError
    from memfit.server.run import start_in_thread

    cfg, _ = champion
    with pytest.raises(ModelLoadError, match="no registered model 'tiny' with alias 'nope'") as err:
        start_in_thread(cfg, "models:/tiny@nope", port=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match="no such folder"):
        start_in_thread(cfg, "/no/such/export", port=0)
    with pytest.raises(ConfigError, match=r"serve.port \d+ on 127.0.0.1 is in use"):
        start_in_thread(cfg, port=int(server.url.rsplit(":", 1)[1]))


def _wait_for(url: str, pred, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health").json()
        if pred(health):
            return health
        time.sleep(0.3)
    pytest.fail(f"server never reached the expected state: {health}")


def test_alias_move_is_served_without_restart_and_a_broken_version_keeps_the_old(champion, server, client, tmp_path):
    """Last in this module: it moves the champion alias."""
    cfg, report = champion
    before = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
    answers, stop = [], threading.Event()

    def keep_asking() -> None:  # requests during the swap: none may fail
        while not stop.is_set():
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 4},
                           timeout=60)
            answers.append((r.status_code, r.json().get("model")))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        v2 = register_version(cfg, altered_export(report.safetensors_dir, tmp_path / "v2" / "hf", scale=1.5))
        assert v2 == "2"
        _wait_for(server.url, lambda h: h["model"] == "tiny/v2")
    finally:
        stop.set()
        asker.join(60)
    after = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
    assert after.model == "tiny/v2" and after.choices[0].text != before.choices[0].text
    assert answers and all(status == 200 for status, _ in answers), answers
    assert {m for _, m in answers} <= {"tiny/v1", "tiny/v2"}

    v3 = register_version(cfg, corrupted_export(tmp_path / "v2" / "hf", tmp_path / "v3" / "hf"))
    health = _wait_for(server.url, lambda h: h["last_error"] is not None)
    assert health["model"] == "tiny/v2" and f"version {v3}" in health["last_error"]
    assert "sha256" in health["last_error"] and "kept tiny/v2" in health["last_error"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).model == "tiny/v2"

    # The retrain flow's step (flows/serve_model.py): it asks the server to poll now, and reports what it kept.
    from flows.serve_model import refresh
    from memfit.errors import ModelLoadError

    assert refresh(server.url, "2", timeout_s=30)["model"] == "tiny/v2"
    with pytest.raises(ModelLoadError, match=f"kept tiny/v2: version {v3} "):
        refresh(server.url, v3, timeout_s=30)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'memfit_model_swaps_total{result="ok"} 1.0' in metrics
    assert 'memfit_model_swaps_total{result="failed"} 1.0' in metrics
