"""memfit serve-model over a real tiny champion (trained once, registered in a SQLite MLflow store), spoken to with
the `openai` client on 127.0.0.1: completions, chat, streaming, logprobs, bad input, both backends, the alias moving."""

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
def hf_server(champion):
    """The champion's export folder served by the transformers backend (`server` serves it through onnxruntime)."""
    from memfit.server.run import start_in_thread

    cfg, report = champion
    hf_cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"backend": "transformers"})})
    running = start_in_thread(hf_cfg, str(report.onnx_path).rsplit("/", 1)[0], port=0)
    yield running
    running.stop()


def _openai(running):
    import openai

    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return _openai(server)


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


def test_both_backends_serve_the_same_greedy_text(server, hf_server, client):
    running = hf_server
    assert httpx.get(f"{server.url}/health").json()["backend"] == "onnx"  # auto on CPU, the export has ONNX
    assert httpx.get(f"{running.url}/health").json()["backend"] == "transformers"
    body = {"model": "export", "prompt": "the cat", "max_tokens": 10, "temperature": 0}
    got = httpx.post(f"{running.url}/v1/completions", json=body).json()["choices"][0]["text"]
    want = client.completions.create(**{**body, "model": "tiny"}).choices[0].text
    assert got == want
    # The same log-probabilities from onnxruntime and from transformers, within the export's parity bound.
    score = {"prompt": "the cat sat on the", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    hf = httpx.post(f"{running.url}/v1/completions", json={**score, "model": "export"}).json()["choices"][0]
    ort = client.completions.create(**{**score, "model": "tiny"}).choices[0]
    assert hf["logprobs"]["tokens"] == ort.logprobs.tokens
    assert hf["logprobs"]["token_logprobs"][0] is None and ort.logprobs.token_logprobs[0] is None
    assert hf["logprobs"]["token_logprobs"][1:] == pytest.approx(ort.logprobs.token_logprobs[1:], abs=1e-4)


def _direct_logprobs(hf_dir: str, ids: list[int]) -> list[float]:
    """log p(token | before) for ids[1:], straight from transformers on the export: the oracle for the server."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


def test_logprobs_from_both_endpoints_through_the_openai_client(champion, client):
    _, report = champion
    prompt = "one two three four"
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == scored.usage.prompt_tokens and "".join(lp.tokens) == prompt
    ids = _token_ids(report.safetensors_dir, prompt)
    assert lp.token_logprobs[1:] == pytest.approx(_direct_logprobs(report.safetensors_dir, ids), abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) >= lp.token_logprobs[i + 1]
               for i, top in enumerate(lp.top_logprobs[1:]))
    # The same prompt as token ids (as lm-evaluation-harness sends it): the same answer.
    by_ids = client.completions.create(model="tiny", prompt=[ids], max_tokens=0, echo=True, logprobs=3)
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs

    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    glp = greedy.choices[0].logprobs
    assert len(glp.tokens) == greedy.usage.completion_tokens >= 1
    assert all(t == max(top.values()) for t, top in zip(glp.token_logprobs, glp.top_logprobs, strict=True))

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob and c.logprob <= 0 for c in content)  # greedy: its own top
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                           max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


@pytest.mark.parametrize("backend", ["onnx", "transformers"])
def test_streamed_logprobs_joined_equal_the_answer_without_stream(backend, request):
    """With stream each chunk carries its own tokens' logprobs; joined they are the answer without stream: the same
    tokens, text and offsets, the numbers within 1e-5 (each chunk is scored from a prefix of the sequence)."""
    running = request.getfixturevalue({"onnx": "server", "transformers": "hf_server"}[backend])
    assert httpx.get(f"{running.url}/health").json()["backend"] == backend
    api, model = _openai(running), running.state.holder.current.files.name
    for ask in ({"prompt": "the cat sat on the", "max_tokens": 6, "logprobs": 3, "echo": True},
                {"prompt": "one two three", "max_tokens": 8, "logprobs": 2}):
        body = {"model": model, "temperature": 0, **ask}
        whole = api.completions.create(**body).choices[0]
        chunks = [c.choices[0] for c in api.completions.create(**body, stream=True)]
        assert "".join(c.text for c in chunks) == whole.text and whole.text
        want, parts = whole.logprobs, [c.logprobs for c in chunks]
        assert sum(1 for lp in parts if lp.tokens) > 2, ask  # token by token, not all at the end
        assert [t for lp in parts for t in lp.tokens] == want.tokens
        assert [o for lp in parts for o in lp.text_offset] == want.text_offset
        assert [x for lp in parts for x in lp.token_logprobs] == pytest.approx(want.token_logprobs, abs=1e-5)
        tops = [top for lp in parts for top in lp.top_logprobs]
        assert len(tops) == len(want.top_logprobs) and all(
            got == (None if top is None else pytest.approx(top, abs=1e-5))
            for got, top in zip(tops, want.top_logprobs, strict=True))

    body = {"model": model, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    whole = api.chat.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in api.chat.completions.create(**body, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    got, want = [e for c in chunks for e in c.logprobs.content], whole.logprobs.content
    # The tiny champion's chat replies are short ("." then the end of text): many tokens are the completions' part.
    assert want and [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in want]
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in e.top_logprobs] for e in want]

    def numbers(entries):
        return [lp for e in entries for lp in (e.logprob, *(t.logprob for t in e.top_logprobs))]

    assert numbers(got) == pytest.approx(numbers(want), abs=1e-5)


def _token_ids(hf_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False)["input_ids"]


def test_lm_eval_local_completions_scores_like_its_hf_backend(champion, server, tmp_path, monkeypatch):
    """lm-evaluation-harness's own OpenAI-compatible client, pointed at the server, against its transformers backend
    on the same export: a local multiple-choice task (log-likelihoods), per choice within 1e-3, accuracy equal."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, report = champion
    pairs = [("the", "dog"), ("cat", "ran"), ("sat", "to"), ("on", "the"), ("a", "end"), ("mat", "of"),
             ("by", "a"), ("the", "long"), ("door", "road"), ("and", "one")]
    rows = [{"question": f"{a} {b}", "choices": [f" {c}" for c in (a, b, "sat", "the")], "answer": i % 4}
            for i, (a, b) in enumerate(pairs)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "memfit_mc.yaml").write_text(
        "task: memfit_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=str(tmp_path))
    hf_dir = report.safetensors_dir
    runs = {name: simple_evaluate(model=name, model_args=args, tasks=["memfit_mc"], task_manager=tasks,
                                  log_samples=True, batch_size=1)
            for name, args in (("hf", {"pretrained": hf_dir, "device": "cpu", "dtype": "float32"}),
                               ("local-completions", {"base_url": f"{server.url}/v1/completions", "model": "tiny",
                                                      "tokenizer": hf_dir, "max_retries": 1}))}
    hf, api = (runs[k] for k in ("hf", "local-completions"))
    assert api["results"]["memfit_mc"]["acc,none"] == hf["results"]["memfit_mc"]["acc,none"]
    lls = {k: [[resp[0] for resp in s["filtered_resps"]] for s in sorted(r["samples"]["memfit_mc"],
                                                                        key=lambda s: s["doc_id"])]
           for k, r in runs.items()}
    assert len(lls["hf"]) == len(rows) and all(len(choices) == 4 for choices in lls["hf"])
    for ours, theirs in zip(lls["local-completions"], lls["hf"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-3)


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

