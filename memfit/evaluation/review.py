"""Evaluation for review: perplexity, greedy generations for fixed prompts, the loss curve and the run's note."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch

from memfit.tracking.base import Tracker

log = logging.getLogger("memfit.evaluation.review")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged run reports a huge number, not inf


@torch.no_grad()
def generate_samples(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int,
                     device: torch.device, special_tokens: bool = True) -> list[dict[str, Any]]:
    """Greedy continuations (KV cache on) of each prompt, one at a time so no padding changes a result."""
    was_training = model.training
    model.eval()
    rows = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        for prompt in prompts:
            # A rendered chat template already holds its special tokens (bos): special_tokens=False adds none.
            enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=special_tokens)
            ids = enc["input_ids"].to(device)
            if ids.shape[1] == 0:  # an empty prompt: start from the bos/eos token
                ids = torch.tensor([[tokenizer.bos_token_id or pad]], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1, use_cache=True, pad_token_id=pad)
            new = out[0, ids.shape[1]:]
            rows.append({"prompt": prompt, "completion": tokenizer.decode(new, skip_special_tokens=True),
                         "new_tokens": int(new.numel())})
    finally:
        model.train(was_training)
    return rows


def heldout_prompt(tokenizer: Any, example: dict[str, Any]) -> tuple[str, str]:
    """(the prompt a model answers, the reference answer) of a held-out example; messages get the chat template,
    up to the last assistant turn, with the generation prompt."""
    if "messages" in example:
        turns = example["messages"]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=len(turns))
        reference = turns[last]["content"] if last < len(turns) else ""
        return tokenizer.apply_chat_template(turns[:last], tokenize=False, add_generation_prompt=True), reference
    return example["prompt"], example["completion"]


def generate_heldout(model: Any, tokenizer: Any, examples: list[dict[str, Any]], max_new_tokens: int,
                     device: torch.device) -> list[dict[str, Any]]:
    """Greedy answers to held-out validation prompts (template applied), beside their reference answers."""
    pairs = [heldout_prompt(tokenizer, e) for e in examples]
    rows = generate_samples(model, tokenizer, [p for p, _ in pairs], max_new_tokens, device, special_tokens=False)
    return [{**row, "reference": ref} for row, (_, ref) in zip(rows, pairs, strict=True)]


def log_generations(tracker: Tracker, rows: list[dict[str, Any]], step: int,
                    name: str = "eval/generations.json") -> None:
    """The generations as an MLflow table (eval/generations.json: the UI's artifact view shows it as a grid)."""
    if not rows:
        return
    table = {key: [r[key] for r in rows] for key in rows[0]}
    table["step"] = [step] * len(rows)
    tracker.log_table(table, name)


def run_description(report: dict[str, Any]) -> str:
    """A short Markdown note for the run's page (mlflow.note.content): the outcome at a glance."""
    lines = ["**memfit run**", ""]
    for key, value in report.items():
        if value is not None:
            shown = json.dumps(value) if isinstance(value, (dict, list)) else value
            lines.append(f"- {key}: {shown}")
    return "\n".join(lines)
