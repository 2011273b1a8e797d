"""Examples to token ids and labels: -100 where data.train_on does not train (token offsets, never text search)."""

from __future__ import annotations

import logging
from typing import Any

from memfit.config import DataConfig
from memfit.data.formats import Corpus
from memfit.data.templates import chat_template, render_many, render_turns, template_source
from memfit.errors import DataError, ModelLoadError

log = logging.getLogger("memfit.data")
IGNORE = -100  # the label transformers' causal-LM loss skips
Encoded = tuple[list[int], list[int]]  # (input_ids, labels) of one example


def eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "bos_token_id", None)
    if eos is None:
        raise ModelLoadError("model.name_or_path: the tokenizer has no eos (or bos) token to separate "
                             "documents; use a tokenizer that defines one")
    return int(eos)


def _token_ids(tokenizer: Any, texts: list[str], chunk: int = 1024) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(texts), chunk):
        # Batched calls run in the Rust tokenizer's thread pool; verbose=False silences the "longer than the
        # model's maximum" warning (overlong examples are data.overlong's business).
        out += tokenizer(texts[start:start + chunk], add_special_tokens=False, verbose=False)["input_ids"]
    return out


def last_run(mask: list[int]) -> list[int]:
    """Only the last contiguous run of 1s in `mask` (the final assistant turn)."""
    out = [0] * len(mask)
    i = len(mask) - 1
    while i >= 0 and not mask[i]:
        i -= 1
    while i >= 0 and mask[i]:
        out[i] = 1
        i -= 1
    return out


def encode_examples(corpus: Corpus, tokenizer: Any, data: DataConfig) -> list[Encoded]:
    """(input_ids, labels) of every example under data.train_on; each example ends with eos (or the template's)."""
    out, no_answer = encode_counted(corpus, tokenizer, data)
    warn_no_answer(no_answer)
    return out


def warn_no_answer(no_answer: int) -> None:
    if no_answer:
        log.warning("data: %d conversation(s) have no assistant turn: nothing in them is trained", no_answer)


def encode_counted(corpus: Corpus, tokenizer: Any, data: DataConfig) -> tuple[list[Encoded], int]:
    """encode_examples without the log: (encoded, conversations with no trained turn), so a worker encoding one
    slice of the records reports its count and the parent logs the sum once."""
    fmt, train_on, eos = corpus.format, data.train_on, eos_id(tokenizer)
    if fmt == "text":
        if train_on != "all":
            raise DataError(f"data.train_on: {train_on} needs prompt_completion or messages records, and "
                            f"{corpus.origins[0][0]} holds text; set data.train_on: all (or data.format)")
        out = []
        for ids in _token_ids(tokenizer, [e["text"] for e in corpus.examples]):
            ids = [*ids, eos]
            out.append((ids, list(ids)))
        return out, 0
    if fmt == "prompt_completion":
        prompts = _token_ids(tokenizer, [e["prompt"] for e in corpus.examples])
        completions = _token_ids(tokenizer, [e["completion"] for e in corpus.examples])
        out = []
        # Prompt and completion are tokenized apart, so the boundary is a token index by construction.
        for p, c in zip(prompts, completions, strict=True):
            c = [*c, eos]
            out.append(([*p, *c], [*([IGNORE] * len(p)), *c] if train_on != "all" else [*p, *c]))
        return out, 0
    chat_template(tokenizer, data)  # fails once, clearly, for a missing template
    out, no_answer, source = [], 0, template_source(data)
    rendered = render_many(tokenizer, [e["messages"] for e in corpus.examples], masks=train_on != "all")
    for i, (example, where) in enumerate(zip(corpus.examples, corpus.origins, strict=True)):
        ids, mask = rendered[i] if rendered is not None else render_turns(
            tokenizer, example["messages"], where, data.messages_field, source, masks=train_on != "all")
        if train_on == "completion":
            mask = last_run(mask)
        if train_on != "all" and not any(mask):
            no_answer += 1
        out.append((ids, ids if train_on == "all" else [t if m else IGNORE for t, m in zip(ids, mask, strict=True)]))
    return out, no_answer


def fit_overlong(encoded: list[Encoded], origins: list[tuple[str, int]], seq_len: int, policy: str, field: str
                 ) -> tuple[list[Encoded], list[int], dict[str, int]]:
    """Examples longer than seq_len truncated, dropped or refused (data.overlong); (kept, their indices, counts)."""
    kept, index, counts = [], [], {"truncated": 0, "dropped": 0}
    for i, (ids, labels) in enumerate(encoded):
        if len(ids) > seq_len:
            if policy == "error":
                where, n = origins[i]
                raise DataError(f"data.overlong: {where} record {n}: field {field!r} is {len(ids)} tokens, more "
                                f"than data.seq_len={seq_len}; raise data.seq_len, or set data.overlong to "
                                "truncate or drop")
            if policy == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        kept.append((ids, labels))
        index.append(i)
    return kept, index, counts
