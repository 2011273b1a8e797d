"""Log-probabilities as the server returns them: the numbers against a direct log-softmax, the OpenAI shapes, and the
request rules (echo, max_tokens 0, token-id prompts, top_logprobs without logprobs)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memfit.server import protocol as p
from memfit.server.logprobs import CompletionChunks, chat_logprobs, completion_logprobs, score

pytestmark = pytest.mark.unit
LOGITS = np.random.default_rng(0).normal(size=(5, 11)).astype(np.float32)
IDS = [3, 7, 1, 1, 9]


def _direct(row: np.ndarray, token: int) -> float:
    z = row.astype(np.float64)
    return float(z[token] - math.log(np.exp(z).sum()))


def test_each_token_is_scored_from_the_logits_before_it():
    got = score(LOGITS, IDS, 0, 3)
    assert [s.token for s in got] == IDS and got[0].logprob is None and got[0].top == ()
    for t in range(1, 5):
        assert got[t].logprob == pytest.approx(_direct(LOGITS[t - 1], IDS[t]), abs=1e-9)
        ranked = np.argsort(-LOGITS[t - 1].astype(np.float64), kind="stable")[:3]
        assert [i for i, _ in got[t].top] == ranked.tolist()  # largest first
        assert got[t].top[0][1] >= got[t].top[1][1] >= got[t].top[2][1]
    assert sum(math.exp(_direct(LOGITS[0], v)) for v in range(11)) == pytest.approx(1.0)


def test_scoring_from_a_later_position_scores_only_the_completion():
    tail = score(LOGITS, IDS, 3, 1)
    assert [s.token for s in tail] == IDS[3:]
    assert [s.logprob for s in tail] == [s.logprob for s in score(LOGITS, IDS, 0, 1)[3:]]
    with pytest.raises(ValueError, match="5 rows of logits for 4 tokens"):
        score(LOGITS, IDS[:4], 0, 1)


def test_a_greedy_token_equals_its_top_one_exactly():
    # lm-evaluation-harness calls a continuation greedy when each token's logprob == max(top_logprobs.values())
    greedy = [int(LOGITS[0].argmax())]
    logits = np.vstack([LOGITS[0], LOGITS[1]])
    out = completion_logprobs(score(logits, [2, *greedy], 0, 1), lambda t: f"<{t}>")
    assert out["token_logprobs"][1] == max(out["top_logprobs"][1].values())
    assert out["tokens"] == ["<2>", f"<{greedy[0]}>"] and out["text_offset"] == [0, 3]
    assert out["top_logprobs"][0] is None


def test_the_chat_shape_names_tokens_bytes_and_alternatives():
    out = chat_logprobs(score(LOGITS, IDS, 2, 2), lambda t: "é" if t == 1 else str(t))
    first = out["content"][0]
    assert first["token"] == "é" and first["bytes"] == [0xC3, 0xA9] and len(first["top_logprobs"]) == 2
    assert [c["logprob"] for c in out["content"]] == [s.logprob for s in score(LOGITS, IDS, 2, 0)]


def test_stream_chunks_offsets_go_on_from_the_previous_chunk():
    scored = score(LOGITS, IDS, 0, 2)
    piece = lambda t: "ab" if t == 7 else str(t)  # noqa: E731
    chunks = CompletionChunks(piece)
    parts = [chunks(scored[:2]), chunks([]), chunks(scored[2:])]
    whole = completion_logprobs(scored, piece)
    assert {k: sum((part[k] for part in parts), []) for k in whole} == whole
    assert parts[1] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_request_rules_for_logprobs_and_echo():
    req = p.CompletionRequest(model="m", prompt=[[5, 6, 7]], max_tokens=0, echo=True, logprobs=1)
    assert p.single_prompt(req) == [5, 6, 7] and p.scoring(req) == 1
    assert p.single_prompt(p.CompletionRequest(model="m", prompt=[5, 6])) == [5, 6]
    for bad, needle, param in (
        (p.CompletionRequest(model="m", prompt="x", max_tokens=0), "set echo to true", "max_tokens"),
        (p.ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=2), "logprobs to true",
         "top_logprobs"),
    ):
        with pytest.raises(p.RequestError, match=needle) as err:
            p.scoring(bad)
        assert err.value.status == 400 and err.value.param == param
    assert p.scoring(p.ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True)) == 0
    assert p.scoring(p.ChatRequest(model="m", messages=[{"role": "user", "content": "x"}])) is None
    # With stream too: each chunk carries its own tokens' logprobs.
    assert p.scoring(p.CompletionRequest(model="m", prompt="x", logprobs=2, stream=True, echo=True)) == 2
    assert p.scoring(p.ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                   top_logprobs=3, stream=True)) == 3
    with pytest.raises(p.RequestError, match="token id 40 is outside the model's vocabulary of 32"):
        p.checked_ids([1, 40], 32)
