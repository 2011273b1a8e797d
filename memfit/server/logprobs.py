"""Log-probabilities of a token sequence from the model's logits, in the OpenAI completions and chat shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_TOP = 20  # OpenAI's own bound on logprobs / top_logprobs


@dataclass(frozen=True)
class Scored:
    """One position: its token, the log-probability the model gave it, and the model's top-k there."""

    token: int
    logprob: float | None  # None for the first token of a sequence: nothing precedes it
    top: tuple[tuple[int, float], ...]


def score(logits: np.ndarray, ids: list[int], start: int, k: int) -> list[Scored]:
    """Pure: log p(ids[t] | ids[:t]) for t in [start, len(ids)) from `logits` (len(ids), vocab) of one forward pass
    over `ids`, with the k most likely tokens at each position (largest first; ties by token id)."""
    if logits.shape[0] != len(ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(ids)} tokens")
    out = [Scored(ids[0], None, ())] if start == 0 and ids else []
    rows = logits[max(start, 1) - 1:len(ids) - 1].astype(np.float64)
    if len(rows):
        z = rows - rows.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for t, row in zip(range(max(start, 1), len(ids)), logp, strict=True):
            top = np.argpartition(-row, k - 1)[:k] if k else np.empty(0, dtype=np.int64)
            top = top[np.lexsort((top, -row[top]))]  # a partition is unordered: largest first, ties by id
            out.append(Scored(ids[t], float(row[ids[t]]), tuple((int(i), float(row[i])) for i in top)))
    return out


Piece = Callable[[int], str]


def completion_logprobs(scored: list[Scored], piece: Piece, text_start: int = 0) -> dict[str, Any]:
    """The /v1/completions `logprobs` object: tokens, token_logprobs, top_logprobs (a dict per position) and each
    token's character offset in the returned text."""
    tokens, offsets, at = [], [], text_start
    for s in scored:
        tokens.append(piece(s.token))
        offsets.append(at)
        at += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [None if s.logprob is None else {piece(i): lp for i, lp in s.top} for s in scored],
            "text_offset": offsets}


class CompletionChunks:
    """The completions `logprobs` of a stream's chunks, one call per chunk: its own tokens, with text_offset going
    on from the previous chunk's, so the chunks joined equal the answer without stream."""

    def __init__(self, piece: Piece):
        self.piece, self.at = piece, 0

    def __call__(self, scored: list[Scored]) -> dict[str, Any]:
        out = completion_logprobs(scored, self.piece, self.at)
        self.at += sum(len(t) for t in out["tokens"])
        return out


def chat_logprobs(scored: list[Scored], piece: Piece) -> dict[str, Any]:
    """The /v1/chat/completions `logprobs` object: one entry per generated token, each with its top_logprobs."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(s.token, s.logprob or 0.0), "top_logprobs": [entry(i, lp) for i, lp in s.top]}
                        for s in scored], "refusal": None}
