"""Request validation, the bounded queue and batching of memfit serve-model, with a character-level stand-in model."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from memfit.server import protocol as p
from memfit.server.backends import Sampling, pick
from memfit.server.sources import ModelFiles

pytestmark = pytest.mark.unit
LIMITS = p.Limits(context=64, max_tokens=32, default_max_tokens=8)


def test_max_tokens_within_the_limits_is_granted():
    assert p.max_new_tokens(10, 5, LIMITS) == 10
    assert p.max_new_tokens(None, 5, LIMITS) == 8  # the default


def test_max_tokens_beyond_the_context_is_refused_with_the_most_that_fits():
    with pytest.raises(p.RequestError) as err:
        p.max_new_tokens(30, 40, LIMITS)
    assert err.value.status == 400 and err.value.param == "max_tokens"
    assert "context of 64" in err.value.message and "at most 24" in err.value.message


def test_the_default_is_cut_to_the_context_instead_of_failing():
    assert p.max_new_tokens(None, 60, LIMITS) == 4


def test_server_cap_prompt_too_long_and_empty_prompt_are_400():
    for args, needle in (((33, 5), "serve.max_tokens"), ((1, 64), "shorten it"), ((1, 0), "empty")):
        with pytest.raises(p.RequestError, match=needle) as err:
            p.max_new_tokens(*args, LIMITS)
        assert err.value.status == 400


def test_prompt_lists_and_stops():
    assert p.single_prompt(p.CompletionRequest(model="m", prompt=["one"])) == "one"
    with pytest.raises(p.RequestError, match="one prompt per request"):
        p.single_prompt(p.CompletionRequest(model="m", prompt=["a", "b"]))
    assert p.stops(p.CompletionRequest(model="m", prompt="x", stop="\n")) == ["\n"]
    with pytest.raises(p.RequestError, match="up to 4"):
        p.stops(p.CompletionRequest(model="m", prompt="x", stop=list("abcde")))


def test_validation_errors_become_one_line_naming_the_field():
    assert p.validation_message([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                  "ctx": {"error": "Expecting value"}}])[0].startswith("the request body is not valid")
    msg, param = p.validation_message([{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}])
    assert (msg, param) == ("prompt: Field required", "prompt")


def test_pick_is_argmax_when_greedy_and_stays_inside_top_p():
    logits = np.array([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert pick(logits, Sampling(), np.random.default_rng(0)).tolist() == [1, 0]
    rng = np.random.default_rng(0)
    draws = {int(pick(logits[:1], Sampling(temperature=1.0, top_p=0.5), rng)[0]) for _ in range(50)}
    assert draws == {1}  # token 1 alone holds more than half the mass
    draws = {int(pick(logits[:1], Sampling(temperature=5.0), rng)[0]) for _ in range(200)}
    assert draws == {0, 1, 2}


def test_choose_backend():
    from memfit.errors import ModelLoadError
    from memfit.server.model import choose_backend

    with_onnx = ModelFiles(Path("hf"), Path("model.onnx"), "m", "m/v1", "1")
    without = ModelFiles(Path("hf"), None, "m", "m/v1", "1")
    assert choose_backend("auto", "cpu", with_onnx) == "onnx"  # measured faster on CPU (docs/serving.md)
    assert choose_backend("auto", "cuda", with_onnx) == "transformers"
    assert choose_backend("auto", "cpu", without) == "transformers"
    assert choose_backend("transformers", "cpu", with_onnx) == "transformers"
    with pytest.raises(ModelLoadError, match="no ONNX export"):
        choose_backend("onnx", "cpu", without)
    with_gguf = ModelFiles(Path("hf"), Path("model.onnx"), "m", "m/v1", "1", gguf_dir=Path("gguf"))
    assert choose_backend("llama.cpp", "cpu", with_gguf) == "llama.cpp"
    assert choose_backend("auto", "cpu", with_gguf) == "onnx"  # auto never picks llama.cpp
    with pytest.raises(ModelLoadError, match="no GGUF export"):
        choose_backend("llama.cpp", "cpu", without)


# -- the engine, with a stand-in model: characters are tokens, and the "model" spells out a fixed reply ----------


class CharTokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(m["content"] for m in messages) + ">"


@dataclass
class SpellingBackend:
    """Replies `reply` to every prompt, one character per step; records the batches it was given."""

    reply: str = "hello world."
    name: str = "stand-in"
    batches: list[int] = field(default_factory=list)
    gate: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)

    def generate(self, prompts, max_new, sampling, emit, done):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(len(prompts))
        for ch in self.reply[:max_new]:
            if all(done()):
                return
            emit([ord(ch)] * len(prompts))

    def logits(self, ids):
        # Each row from the tokens up to it alone, as a causal model's: scoring a prefix gives the same rows.
        return np.stack([np.stack([np.random.default_rng(list(row[:t + 1])).normal(size=128) for t in range(len(row))])
                         for row in ids.tolist()]).astype(np.float32)


@dataclass
class StandIn:
    backend: SpellingBackend
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    eos_id: int | None = ord(".")
    limits: p.Limits = LIMITS
    files: ModelFiles = field(default_factory=lambda: ModelFiles(Path("hf"), None, "m", "m/v1", "1"))

    model_id = "m/v1"
    names = {"m", "m/v1"}
    has_chat_template = True

    def encode(self, text):
        return self.tokenizer(text)["input_ids"]

    def chat_prompt(self, messages):
        return self.tokenizer.apply_chat_template(messages)

    def piece(self, token):
        return chr(token)


def _client(backend: SpellingBackend, max_queue: int = 8, max_batch: int = 4):
    from fastapi.testclient import TestClient

    from memfit.server.app import ServerState, create_app
    from memfit.server.engine import Engine
    from memfit.server.follower import Holder
    from memfit.server.metrics import Metrics

    holder = Holder(current=StandIn(backend))
    metrics = Metrics()
    engine = Engine(holder, max_batch=max_batch, max_queue=max_queue, wait_ms=50, metrics=metrics).start()
    state = ServerState(holder=holder, engine=engine, metrics=metrics)
    return TestClient(create_app(state)), engine


def test_completion_stops_at_end_of_text_and_counts_tokens():
    client, engine = _client(SpellingBackend())
    try:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 20})
        body = r.json()
        assert r.status_code == 200, body
        assert body["choices"][0]["text"] == "hello world"  # the end-of-text token itself is not text
        assert body["choices"][0]["finish_reason"] == "stop" and body["model"] == "m/v1"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 11, "total_tokens": 13}
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
        assert r.json()["choices"][0] | {"logprobs": None} == {"index": 0, "text": "hel", "logprobs": None,
                                                                "finish_reason": "length"}
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stop": " w"})
        assert r.json()["choices"][0]["text"] == "hello" and r.json()["choices"][0]["finish_reason"] == "stop"
        metrics = client.get("/metrics").text  # 11 + 3 + 7 (" w" ends at the 7th token)
        assert 'memfit_tokens_total{kind="completion"} 21.0' in metrics
        assert 'memfit_requests_total{endpoint="/v1/completions",status="200"} 3.0' in metrics
    finally:
        engine.stop()


def test_streamed_chat_sends_the_reply_in_pieces_then_done():
    client, engine = _client(SpellingBackend())
    try:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 20}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == "hello world"
        assert len(chunks) > 3  # token by token, not the whole reply in one chunk
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        engine.stop()


def _sse_choices(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]


def test_streamed_logprobs_joined_are_the_answer_without_stream():
    """Each chunk carries its own tokens' logprobs; joined they equal the one answer, also when the end of text, a
    stop string (its text cut, its tokens scored) or the budget ends it, and with the echoed prompt."""
    client, engine = _client(SpellingBackend())
    try:
        # (request, tokens scored): "hello world" then the end of text; "hello w" holds the stop string
        for body, n in (({"max_tokens": 20, "logprobs": 2}, 11), ({"max_tokens": 4, "logprobs": 0}, 4),
                        ({"stop": "o w", "logprobs": 1}, 7), ({"max_tokens": 5, "echo": True, "logprobs": 3}, 2 + 5),
                        ({"max_tokens": 0, "echo": True, "logprobs": 3}, 2)):
            body = {"model": "m", "prompt": "hi", **body}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            chunks = _sse_choices(client, "/v1/completions", body)
            assert "".join(c["text"] for c in chunks) == whole["text"]
            joined = {k: sum((c["logprobs"][k] for c in chunks), []) for k in whole["logprobs"]}
            assert joined == whole["logprobs"], body  # the stand-in's rows depend on the prefix alone: exact
            assert len(joined["tokens"]) == n, body
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
                "stop": "o w"}
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        chunks = _sse_choices(client, "/v1/chat/completions", body)
        assert "".join(c["delta"].get("content", "") for c in chunks) == whole["message"]["content"] == "hell"
        assert sum((c["logprobs"]["content"] for c in chunks), []) == whole["logprobs"]["content"]
        assert len([c for c in chunks if c["logprobs"]["content"]]) > 3  # token by token, not all at the end
        plain = _sse_choices(client, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
        assert all(c["logprobs"] is None for c in plain)
    finally:
        engine.stop()


class FailingScores(SpellingBackend):
    def logits(self, ids):
        raise RuntimeError("no logits today")


@pytest.mark.timeout(60)  # the bug this guards against was a request waiting forever
def test_a_failed_batch_answers_every_request_also_one_generated_in_full():
    client, engine = _client(FailingScores())
    try:
        for body in ({"max_tokens": 0, "echo": True, "logprobs": 1}, {"max_tokens": 20, "logprobs": 1}):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", **body})
            assert r.status_code == 500 and "no logits today" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": True}) as r:
            last = [line for line in r.iter_lines() if line][-2]  # before [DONE]
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "generation_failed"
    finally:
        engine.stop()


def test_requests_that_wait_together_share_a_batch():
    gate = threading.Event()
    backend = SpellingBackend(gate=gate)
    client, engine = _client(backend, max_batch=4)
    results = []

    def post(prompt: str) -> None:
        results.append(client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 5}).json())

    try:
        blocker = threading.Thread(target=post, args=("first",))
        blocker.start()
        backend.entered.wait(10)  # the first request is generating (held at the gate)
        threads = [threading.Thread(target=post, args=(f"p{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        while engine.queue.qsize() < 4:  # the four wait in the queue meanwhile
            threading.Event().wait(0.01)
        gate.set()
        for t in [blocker, *threads]:
            t.join(10)
        assert [r["choices"][0]["text"] for r in results] == ["hello"] * 5
        assert backend.batches == [1, 4]
    finally:
        gate.set()
        engine.stop()


def test_a_full_queue_is_503_and_bad_requests_are_4xx_while_serving_goes_on():
    gate = threading.Event()
    client, engine = _client(SpellingBackend(gate=gate), max_queue=1, max_batch=1)
    try:
        first = threading.Thread(target=lambda: client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        first.start()
        assert engine.holder.current.backend.entered.wait(10)  # the first is in generate, at the gate
        second = threading.Thread(target=lambda: client.post("/v1/completions", json={"model": "m", "prompt": "b"}))
        second.start()
        while engine.queue.qsize() < 1:
            threading.Event().wait(0.01)
        r = client.post("/v1/completions", json={"model": "m", "prompt": "c"})
        assert r.status_code == 503 and "serve.max_queue" in r.json()["error"]["message"]
        gate.set()
        first.join(10)
        second.join(10)
        bad = [client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
               client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 100}),
               client.post("/v1/completions", json={"model": "other", "prompt": "x"}),
               client.post("/v1/completions", json={"model": "m"})]
        assert [b.status_code for b in bad] == [400, 400, 404, 400]
        assert all(b.json()["error"]["message"] for b in bad)
        ok = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "he"
    finally:
        gate.set()
        engine.stop()
