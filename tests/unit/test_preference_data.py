"""Preference pairs as users bring them (TRL's standard and conversational forms): rows, loss masks, bad input."""

from __future__ import annotations

import pytest
import torch
from chat_support import TEMPLATE_SPECIALS, bpe_tokenizer

from memfit import config
from memfit.data.formats import load_texts
from memfit.data.masking import IGNORE
from memfit.data.prepare import prepare_data
from memfit.data.synthetic import synthetic_preference_pairs, write_jsonl
from memfit.data.templates import BUILTIN_TEMPLATES
from memfit.errors import ConfigError, DataError
from memfit.memory.techniques.loss import blocks_batch

pytestmark = pytest.mark.unit
PROMPT = [{"role": "user", "content": "go on from c."}]
CHOSEN = [{"role": "assistant", "content": "d e f."}]
REJECTED = [{"role": "assistant", "content": "f e d."}]


@pytest.fixture(scope="module")
def tok():
    pairs = synthetic_preference_pairs(200, 0)
    t = bpe_tokenizer([p["prompt"] + p["chosen"] + p["rejected"] for p in pairs], TEMPLATE_SPECIALS["chatml"])
    t.chat_template = BUILTIN_TEMPLATES["chatml"]
    return t


def _cfg(path, *extra: str):
    return config.load(None, [f"data.path={path}", "train.objective=dpo", "data.seq_len=64", *extra])


def _trained(ids: torch.Tensor, labels: torch.Tensor, tok) -> str:
    return tok.decode([int(i) for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def test_standard_pairs_train_on_both_completions_only(tmp_path, tok):
    pairs = synthetic_preference_pairs(40, 1)
    bundle = prepare_data(_cfg(write_jsonl(pairs, tmp_path / "pairs.jsonl")), tok)
    assert bundle.stats["format"] == "preference" and bundle.stats["examples"] == 40
    f = bundle.train_fields
    assert {"labels", "attention_mask", "rejected_input_ids", "rejected_labels", "rejected_attention_mask"} <= set(f)
    assert len(bundle.train) + len(bundle.val) == 40
    texts = {(p["chosen"] + "<|endoftext|>", p["rejected"] + "<|endoftext|>") for p in pairs}
    for r in range(len(bundle.train)):  # what is trained is exactly each side's completion (and its eos)
        pair = (_trained(bundle.train[r], f["labels"][r], tok),
                _trained(f["rejected_input_ids"][r], f["rejected_labels"][r], tok))
        assert pair in texts
    # A batch is cut to the longest side of its pairs, chosen and rejected alike.
    batch = blocks_batch(bundle.train, slice(0, 4), None, f)
    assert batch["input_ids"].shape == batch["rejected_input_ids"].shape
    assert batch["input_ids"].shape[1] == max(int(f[k][:4].sum(-1).max()) for k in
                                              ("attention_mask", "rejected_attention_mask"))


@pytest.mark.parametrize("record", [
    {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},  # explicit prompt
    {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED},  # implicit prompt: the shared leading turns
])
def test_conversational_pairs_train_on_the_answer_turns(tmp_path, tok, record):
    bundle = prepare_data(_cfg(write_jsonl([record] * 12, tmp_path / "chat.jsonl")), tok)
    f = bundle.train_fields
    assert _trained(bundle.train[0], f["labels"][0], tok) == "d e f.<|im_end|>\n"
    assert _trained(f["rejected_input_ids"][0], f["rejected_labels"][0], tok) == "f e d.<|im_end|>\n"
    prompt = tok.decode([int(i) for i, lab in zip(bundle.train[0], f["labels"][0], strict=True)
                         if lab == IGNORE and i != tok.pad_token_id])
    assert prompt == "<|im_start|>user\ngo on from c.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("bad,match", [
    ({"prompt": "Q: x\nA:", "chosen": " a b."}, r"data\.rejected_field: .*pairs\.jsonl record 3: field 'rejected' "
                                                r"is missing"),
    ({"prompt": "Q: x\nA:", "chosen": " a b.", "rejected": " a b."}, r"pairs\.jsonl record 3: field 'rejected' "
                                                                      r"is identical to the chosen"),
    ({"prompt": "Q: " + "go on " * 80, "chosen": " a.", "rejected": " b."}, r"data\.seq_len: .*pairs\.jsonl "
                                                                             r"record 3: field 'prompt' is \d+ tokens"),
    ({"chosen": PROMPT + CHOSEN, "rejected": REJECTED}, r"pairs\.jsonl record 3: field 'prompt' is missing"),
])
def test_bad_pairs_name_file_record_and_field(tmp_path, tok, bad, match):
    good = synthetic_preference_pairs(2, 0)
    if "prompt" not in bad:  # a conversational file
        good = [{"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}] * 2
    path = write_jsonl([*good, bad, *good], tmp_path / "pairs.jsonl")
    with pytest.raises(DataError, match=match):
        prepare_data(_cfg(path), tok)


def test_record_numbers_are_editor_lines(tmp_path):
    lines = ['{"text": "fine"}'] * 56 + ['{"text": "broken"'] + ['{"text": "fine"}'] * 3
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl line 57: "):
        load_texts(config.load(None, [f"data.path={tmp_path / 'd.jsonl'}"]).data)
    # Blank lines are skipped by the reader, not by the count an editor shows.
    rows = ['{"prompt": "Q:", "chosen": " a.", "rejected": " b."}', "", '{"prompt": "Q:", "chosen": " a."}']
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl record 3: field 'rejected' is missing"):
        load_texts(_cfg(tmp_path / "p.jsonl").data)
    (tmp_path / "p.csv").write_text("prompt,chosen,rejected\nQ:, a., b.\nQ:, a., a.\n")  # header is line 1
    with pytest.raises(DataError, match=r"p\.csv record 3: field 'rejected' is identical"):
        load_texts(_cfg(tmp_path / "p.csv").data)


def test_objective_and_format_must_agree():
    with pytest.raises(ConfigError, match="train.objective: dpo trains on preference pairs"):
        config.load(None, ["train.objective=dpo", "data.format=messages"])
    with pytest.raises(ConfigError, match="data.format: preference pairs need train.objective: dpo"):
        config.load(None, ["data.format=preference"])
    with pytest.raises(ConfigError, match="dpo.reference: adapter_off .* lora.enabled is false"):
        config.load(None, ["train.objective=dpo", "dpo.reference=adapter_off"])


def test_dpo_on_records_that_are_not_pairs_says_so(tmp_path, tok):
    path = write_jsonl([{"messages": PROMPT + CHOSEN}] * 10, tmp_path / "chat.jsonl")
    with pytest.raises(DataError, match=r"train\.objective: dpo, and .*chat\.jsonl holds messages records"):
        prepare_data(_cfg(path), tok)
    pairs = write_jsonl(synthetic_preference_pairs(10, 0), tmp_path / "pairs.jsonl")
    with pytest.raises(ConfigError, match="preference pairs need train.objective: dpo"):
        prepare_data(config.load(None, [f"data.path={pairs}", "data.format=preference"]), tok)
    with pytest.raises(DataError, match=r"train\.objective: sft, and .*pairs\.jsonl holds preference records"):
        prepare_data(config.load(None, [f"data.path={pairs}"]), tok)


@pytest.mark.parametrize("policy", ["truncate", "drop", "error"])
def test_overlong_pairs_follow_data_overlong(tmp_path, tok, policy):
    long = {"prompt": "Q: go on from a.\nA:", "chosen": " b c d." * 30, "rejected": " d c b."}
    path = write_jsonl([*synthetic_preference_pairs(9, 0), long, *synthetic_preference_pairs(5, 1)],
                       tmp_path / "pairs.jsonl")
    cfg = _cfg(path, f"data.overlong={policy}")
    if policy == "error":
        with pytest.raises(DataError, match=r"data\.overlong: .*pairs\.jsonl record 10: field 'chosen' makes the "
                                            r"pair \d+ tokens, more than data\.seq_len=64"):
            prepare_data(cfg, tok)
        return
    bundle = prepare_data(cfg, tok)
    assert bundle.stats["truncated" if policy == "truncate" else "dropped"] == 1
    assert bundle.stats["examples"] == (15 if policy == "truncate" else 14)
    masks = torch.cat([bundle.train_fields["attention_mask"], bundle.val_fields["attention_mask"]])
    assert (int(masks.sum(-1).max()) == 64) == (policy == "truncate")  # cut to seq_len, or gone
