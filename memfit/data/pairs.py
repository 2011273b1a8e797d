"""Preference pairs to padded rows: chosen and rejected side by side, labels on the completion tokens only."""

from __future__ import annotations

import logging
from typing import Any

import torch

from memfit.config import DataConfig
from memfit.data.formats import Corpus
from memfit.data.masking import IGNORE, Encoded, _token_ids, eos_id
from memfit.data.packing import pack_padded
from memfit.data.templates import chat_template, render_prompt
from memfit.errors import DataError

log = logging.getLogger("memfit.data")
REJECTED = "rejected_"  # the rejected side's fields: rejected_input_ids, rejected_labels, rejected_attention_mask


def _texts(tokenizer: Any, example: dict[str, Any], where: tuple[str, int], data: DataConfig
           ) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as the text the model reads: standard pairs as they are; conversational ones
    rendered with the chat template, each completion the text its turns add after the generation prompt."""
    prompt = example["prompt"]
    if isinstance(prompt, str):
        return prompt, example["chosen"], example["rejected"]
    prompt_text = render_prompt(tokenizer, prompt)
    out = [prompt_text]
    for side, name in (("chosen", data.chosen_field), ("rejected", data.rejected_field)):
        full = tokenizer.apply_chat_template([*prompt, *example[side]], tokenize=False)
        if not full.startswith(prompt_text):
            raise DataError(f"data.chat_template: {where[0]} record {where[1]}: field {name!r}: the template renders "
                            "the prompt differently once the answer follows, so the completion cannot be cut "
                            "from it; use another data.chat_template")
        out.append(full[len(prompt_text):])
    return out[0], out[1], out[2]


def _fit(prompt: list[int], completion: list[int], seq_len: int, policy: str, where: tuple[str, int],
         data: DataConfig, side: str) -> Encoded | None:
    """One side's (input_ids, labels) within seq_len; the prompt must fit, the completion is cut (data.overlong)."""
    if len(prompt) >= seq_len:
        raise DataError(f"data.seq_len: {where[0]} record {where[1]}: field {data.prompt_field!r} is {len(prompt)} "
                        f"tokens, leaving no room for an answer in data.seq_len={seq_len}; raise data.seq_len or "
                        "shorten the prompt")
    if len(prompt) + len(completion) > seq_len:
        if policy == "error":
            raise DataError(f"data.overlong: {where[0]} record {where[1]}: field {side!r} makes the pair "
                            f"{len(prompt) + len(completion)} tokens, more than data.seq_len={seq_len}; raise "
                            "data.seq_len, or set data.overlong to truncate or drop")
        if policy == "drop":
            return None
        completion = completion[:seq_len - len(prompt)]
    return [*prompt, *completion], [*([IGNORE] * len(prompt)), *completion]


def encode_pairs(corpus: Corpus, tokenizer: Any, data: DataConfig, pad_id: int
                 ) -> tuple[dict[str, torch.Tensor], list[int], dict[str, Any]]:
    """(rows, kept pair -> corpus index, counts): one pair a row, chosen under the usual names and rejected under
    REJECTED + name, each right-padded to data.seq_len (batches are cut to their longest side)."""
    chosen, rejected, index, counts = encode_sides(corpus, tokenizer, data)
    check_kept(len(chosen), counts, data)
    rows, _ = pack_padded(chosen, data.seq_len, pad_id)
    other, _ = pack_padded(rejected, data.seq_len, pad_id)
    rows.update({REJECTED + k: v for k, v in other.items()})
    return rows, index, counts


def check_kept(kept: int, counts: dict[str, int], data: DataConfig) -> None:
    """No pair left is an error; pairs cut or dropped are logged once (for the whole data, not a slice of it)."""
    if not kept:
        raise DataError(f"data.overlong: every pair is longer than data.seq_len={data.seq_len} and was dropped; "
                        "raise data.seq_len")
    if counts["truncated"] or counts["dropped"]:
        log.warning("data: %d pair(s) longer than data.seq_len=%d truncated, %d dropped (data.overlong=%s)",
                    counts["truncated"], data.seq_len, counts["dropped"], data.overlong)


def encode_sides(corpus: Corpus, tokenizer: Any, data: DataConfig
                 ) -> tuple[list[Encoded], list[Encoded], list[int], dict[str, int]]:
    """(chosen sides, rejected sides, kept pair -> corpus index, counts), each side within data.seq_len."""
    if not isinstance(corpus.examples[0]["prompt"], str):
        chat_template(tokenizer, data)  # fails once, clearly, for a missing template
    eos = eos_id(tokenizer)
    texts = [_texts(tokenizer, e, w, data) for e, w in zip(corpus.examples, corpus.origins, strict=True)]
    flat = _token_ids(tokenizer, [t for triple in texts for t in triple])
    chosen: list[Encoded] = []
    rejected: list[Encoded] = []
    index: list[int] = []
    counts = {"truncated": 0, "dropped": 0}
    for i, where in enumerate(corpus.origins):
        prompt, c, r = flat[3 * i:3 * i + 3]
        if isinstance(corpus.examples[i]["prompt"], str):  # a standard completion ends with eos, as TRL's
            c, r = [*c, eos], [*r, eos]
        sides = [_fit(prompt, ids, data.seq_len, data.overlong, where, data, name)
                 for ids, name in ((c, data.chosen_field), (r, data.rejected_field))]
        if sides[0] is None or sides[1] is None:
            counts["dropped"] += 1
            continue
        counts["truncated"] += int(len(prompt) + max(len(c), len(r)) > data.seq_len)
        chosen.append(sides[0])
        rejected.append(sides[1])
        index.append(i)
    return chosen, rejected, index, counts


def with_rejected_side(fields: dict[str, torch.Tensor], trained: list[int], real: list[int]
                       ) -> tuple[list[int], list[int]]:
    """Per-row trained and real token counts with a preference row's rejected side added (unchanged otherwise)."""
    if REJECTED + "labels" not in fields:
        return trained, real
    more_trained = (fields[REJECTED + "labels"][:, 1:] != IGNORE).sum(dim=1).tolist()
    more_real = fields[REJECTED + "attention_mask"].sum(-1).tolist()
    return ([a + b for a, b in zip(trained, more_trained, strict=True)],
            [a + b for a, b in zip(real, more_real, strict=True)])


def pairs_digest(rows: torch.Tensor, fields: dict[str, Any]) -> str:
    """The pairs' content (rows and every field but stored reference log-probs): the eval key and the precomputed
    reference's cache key change with it."""
    import hashlib

    h = hashlib.sha256(rows.contiguous().numpy().tobytes())
    for name in sorted(fields):
        value = fields[name]
        if isinstance(value, torch.Tensor) and not name.startswith("ref_"):
            h.update(name.encode())
            h.update(value.contiguous().numpy().tobytes())
    return h.hexdigest()[:24]
