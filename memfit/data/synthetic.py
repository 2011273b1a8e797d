"""Seeded synthetic data: a text corpus, and conversations / prompt-completion pairs for chat-data tests and benches."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# Small closed vocabularies: a tiny model picks up the templates and the number/letter
# sequences within a few dozen steps, so a falling validation loss is visible in a short run.
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_COLORS = ("red", "blue", "green", "yellow", "black", "white")
_ANIMALS = ("cat", "dog", "fox", "bird", "horse", "fish")
_VERBS = ("sees", "likes", "chases", "finds", "follows", "watches")
_OBJECTS = ("ball", "tree", "house", "river", "box", "hat")
_PATTERNS = ("ab", "red blue", "up down", "tick tock", "one two three", "x y z")


def _counting(rng: random.Random) -> str:
    start = rng.randrange(0, 14)
    n = rng.randint(4, 8)
    return " ".join(_NUMBER_WORDS[start:start + n]) + "."


def _letters(rng: random.Random) -> str:
    start = rng.randrange(0, 20)
    return " ".join(_LETTERS[start:start + rng.randint(4, 7)]) + "."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    if rng.random() < 0.5:
        return f"{a} plus {b} is {a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a} minus {b} is {a - b}."


def _template(rng: random.Random) -> str:
    return (f"the {rng.choice(_COLORS)} {rng.choice(_ANIMALS)} {rng.choice(_VERBS)} "
            f"the {rng.choice(_OBJECTS)}.")


def _repeat(rng: random.Random) -> str:
    return " ".join([rng.choice(_PATTERNS)] * rng.randint(3, 5)) + "."


_GENERATORS = (_counting, _letters, _arithmetic, _template, _repeat)


def synthetic_corpus(n_docs: int, seed: int) -> list[str]:
    """`n_docs` plain-ASCII documents of 3-6 templated sentences; the same seed gives the same texts."""
    # A private Random: the corpus never depends on (or disturbs) the global RNG state.
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [rng.choice(_GENERATORS)(rng) for _ in range(rng.randint(3, 6))]
        docs.append(" ".join(sentences))
    return docs


_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a math tutor.")


def _question_answer(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"what is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        start = rng.randrange(0, 14)
        return (f"count from {_NUMBER_WORDS[start]}.",
                " ".join(_NUMBER_WORDS[start:start + rng.randint(3, 6)]) + ".")
    if kind == 2:
        color, animal = rng.choice(_COLORS), rng.choice(_ANIMALS)
        return f"what does the {color} {animal} do?", f"the {color} {animal} {rng.choice(_VERBS)} the ball."
    start = rng.randrange(0, 20)
    return f"say the letters after {_LETTERS[start]}.", " ".join(_LETTERS[start + 1:start + 5]) + "."


def synthetic_conversations(n: int, seed: int, max_turns: int = 3) -> list[list[dict[str, str]]]:
    """`n` conversations: an optional system turn, then 1..max_turns user/assistant pairs with learnable answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns: list[dict[str, str]] = []
        if rng.random() < 0.6:
            turns.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.randint(1, max_turns)):
            question, answer = _question_answer(rng)
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(turns)
    return out


def synthetic_prompt_completions(n: int, seed: int) -> list[dict[str, str]]:
    """`n` {prompt, completion} records (a question and its answer)."""
    rng = random.Random(seed)
    return [dict(zip(("prompt", "completion"), _prompt_pair(rng), strict=True)) for _ in range(n)]


def _prompt_pair(rng: random.Random) -> tuple[str, str]:
    question, answer = _question_answer(rng)
    return f"Q: {question}\nA:", f" {answer}"


def write_jsonl(records: list[dict[str, Any]], path: str | Path) -> Path:
    """One JSON object a line (the format memfit and TRL read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(records: list[dict[str, Any]], path: str | Path) -> Path:
    """The records as one parquet file (through pyarrow, which datasets installs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return path


def synthetic_preference_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """`n` {prompt, chosen, rejected} pairs with a learnable rule: the chosen answer counts up from the prompt's
    number word or letter, the rejected one holds the same words counting down (so only their order tells them
    apart, and a model that knows no rule ranks a pair by chance)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            start = rng.randrange(0, 14)
            first, words = _NUMBER_WORDS[start], _NUMBER_WORDS[start + 1:start + 1 + rng.randint(3, 5)]
        else:
            start = rng.randrange(0, 20)
            first, words = _LETTERS[start], list(_LETTERS[start + 1:start + 1 + rng.randint(3, 5)])
        out.append({"prompt": f"Q: go on from {first}.\nA:", "chosen": " " + " ".join(words) + ".",
                    "rejected": " " + " ".join(reversed(words)) + "."})
    return out
