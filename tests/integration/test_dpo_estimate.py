"""DPO in the estimator: pairs x 2 rows and each reference mode, against a real DPO step's tracked peak; the plan
for the Llama-3-8B shape on a 24 GB card says which reference mode it counted and why."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from memory_support import VOCAB, tiny

from memfit.config import LoraConfig
from memfit.config.devices import PROFILES
from memfit.memory.estimator.compose import Stack
from memfit.memory.estimator.estimate import Estimator
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import StepTracker
from memfit.memory.techniques.policies import find_blocks
from memfit.training.objective import AdapterOff, DpoObjective, FrozenCopy, Precomputed

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SEQ, PAIRS = 48, 4


class _Pairs:
    """run_step hands a loss policy {"input_ids", "labels"} of 2 x pairs rows: chosen first, rejected after; the
    first `prompt` tokens of every row are a prompt (labels -100)."""

    def __init__(self, objective: DpoObjective, prompt: int = 0) -> None:
        self.objective, self.prompt = objective, prompt

    def __call__(self, model, batch):
        ids = batch["input_ids"]
        labels = ids.clone()
        labels[:, :self.prompt] = -100
        n = ids.shape[0] // 2
        return self.objective(model, {
            "input_ids": ids[:n], "labels": labels[:n], "rejected_input_ids": ids[n:], "rejected_labels": labels[n:],
            "ref_chosen_logps": torch.zeros(n), "ref_rejected_logps": torch.zeros(n)})


def _model(mode: str, vocab: int = VOCAB):
    """The tiny Llama a DPO step trains: with LoRA adapters for adapter_off (the reference is the policy with them
    disabled), else all weights."""
    model = tiny("llama")
    if vocab != VOCAB:
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(model.config)
        config.vocab_size = vocab
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
    if mode == "adapter_off":
        from memfit.models.lora import prepare_lora_model

        model = prepare_lora_model(model, LoraConfig(enabled=True, r=4), "fp32")
    return model


def _measured(mode: str, prompt: int = 0, vocab: int = VOCAB) -> int:
    """The tracked peak of one real DPO step (the objective training runs, its reference as configured)."""
    model = _model(mode, vocab)
    tracker = StepTracker(find_blocks(model))
    reference = {"copy": lambda: FrozenCopy(model), "precompute": Precomputed,
                 "adapter_off": lambda: AdapterOff(model)}[mode]()
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker.track_external(model, optimizer, *([reference.model] if mode == "copy" else []))
    ids = torch.randint(0, vocab, (2 * PAIRS, SEQ), generator=torch.Generator().manual_seed(5))
    with tracker:
        run_step(model, optimizer, [ids], "fp32", tracker,
                 loss_fn=_Pairs(DpoObjective(reference=reference), prompt))
    return tracker.result().peak_bytes


def _estimate(mode: str, prompt: int = 0, vocab: int = VOCAB) -> Any:
    hf = copy.deepcopy(_model("precompute", vocab).config)
    lora = mode == "adapter_off"
    dpo = SimpleNamespace(reference=mode, loss_type="sigmoid")
    est = Estimator(hf, SEQ, PROFILES["cpu"], dpo=dpo, dpo_logits_keep=SEQ - prompt + 1 if prompt else None,
                    lora_cfg=LoraConfig(enabled=True, r=4) if lora else None)
    return est.estimate(Stack("fp32", PAIRS, 1, lora), ["none"] * 4)


# adapter_off runs the policy's root module a second time in the step (no grad): the tracker lets it
# (StepTracker._again_without_grad), so every mode is measured.
@pytest.mark.parametrize("mode", ["copy", "precompute", "adapter_off"])
def test_dpo_estimate_is_within_two_percent_of_the_measured_step(mode):
    predicted = _estimate(mode)
    sft = Estimator(copy.deepcopy(tiny("llama").config), SEQ, PROFILES["cpu"]).estimate(
        Stack("fp32", PAIRS, 1, False), ["none"] * 4)
    measured = _measured(mode)
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.02), (predicted.peak_bytes, measured)
    assert predicted.extra["reference"] == mode
    if mode != "adapter_off":
        assert predicted.peak_bytes > sft.peak_bytes  # 2 rows a pair
    if mode == "copy":
        assert predicted.extra["reference_bytes"] == predicted.weight_bytes


@pytest.mark.parametrize("mode", ["copy", "precompute", "adapter_off"])
def test_a_prompt_skips_the_head_and_the_estimate_follows(mode):
    # 32 of 48 tokens a prompt: the head runs from position 31 (the logits predicting token 32 on), 17 positions.
    prompt = 32
    kept, every = _estimate(mode, prompt), _estimate(mode)
    measured = _measured(mode, prompt)
    assert kept.peak_bytes == pytest.approx(measured, rel=0.02), (kept.peak_bytes, measured)
    assert measured < _measured(mode) and kept.peak_bytes < every.peak_bytes


@pytest.mark.parametrize("mode", ["copy", "adapter_off"])
def test_the_reference_forward_is_traced_where_it_runs(mode):
    """With a vocabulary 256x the width the logits are most of a step: the reference's no-grad forward (its kept
    logits and log-softmax, on top of what the policy's backward needs) is traced in its place in the step, not
    added at every position on top of the peak (which planned 1.3-2x the real step)."""
    predicted, measured = _estimate(mode, 32, vocab=8192), _measured(mode, 32, vocab=8192)
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.02), (predicted.peak_bytes, measured)
    assert "reference" in predicted.peak_at  # where this model's step peaks
    precompute = _estimate("precompute", 32, vocab=8192)
    assert predicted.step_seconds > precompute.step_seconds  # one more forward a step, from the trace


def test_dpo_is_planned_for_the_datas_longest_pair_when_the_data_is_known(tmp_path):
    """A DPO batch is cut to its longest side: with the pairs and the tokenizer at hand the estimate is made at the
    data's longest pair, not data.seq_len; with a config.json alone the worst case, data.seq_len, stays."""
    from memfit import config
    from memfit.data.formats import data_digest, load_texts
    from memfit.data.pairs import encode_pairs
    from memfit.memory.planner import pair_length
    from memfit.memory.planner.search import make_estimator
    from memfit.models.loading import load_model_and_tokenizer

    sets = [f"run.work_dir={tmp_path / 'work'}", "data.seq_len=512", "data.synthetic_docs=200"]
    cfg = config.load(REPO / "configs" / "dpo-tiny.yaml", sets)
    corpus = load_texts(cfg.data)
    _, tokenizer, _ = load_model_and_tokenizer(cfg, corpus, data_digest(corpus))
    rows, _, _ = encode_pairs(corpus, tokenizer, cfg.data, 0)
    longest = max(int(rows[k].sum(-1).max()) for k in ("attention_mask", "rejected_attention_mask"))
    assert 8 < longest < 512
    est = make_estimator(cfg, PROFILES["cpu"])
    assert est.seq_len == pair_length.planned_seq_len(cfg) == longest
    # ...and the head planned from the data's shortest prompt: at most longest - shortest prompt + 1 positions
    shortest = min(int((rows[k] == -100).int().cumprod(dim=1).sum(dim=1).min()) for k in ("labels", "rejected_labels"))
    assert est.dpo_logits_keep == longest - shortest + 1 < longest
    assert est.at_seq_len(512).dpo_logits_keep is None  # other rows: every position
    from memfit.memory.planner.search import estimate_report

    report = estimate_report(cfg, "cpu")  # what `memfit estimate` prints: the rows it traced, not data.seq_len
    assert report["seq_len"] == longest and report["dpo"]["pairs_read"]
    assert report["dpo"]["logits_keep"] == longest - shortest + 1
    assert report["dpo"]["coverage"] > 1 and report["dpo"]["reference"] == "precompute"  # 40 x 8 over < 200 pairs
    stack = Stack("fp32", cfg.train.micro_batch_size, 1, False)
    assert est.estimate(stack, ["none"] * est.n_blocks).peak_bytes < \
        est.at_seq_len(512).estimate(stack, ["none"] * est.n_blocks).peak_bytes

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((REPO / "configs" / "models" / "llama-3-8b" / "config.json").read_text())
    cfg_bare = config.load(REPO / "configs" / "dpo-tiny.yaml", [*sets, f"model.name_or_path={bare}",
                                                                 "model.preset=null"])
    assert pair_length.planned_seq_len(cfg_bare) == 512  # no tokenizer here: the worst case
    assert pair_length.planned_coverage(cfg_bare) is None  # ...and auto's per-step reference


def test_auto_reference_is_planned_as_the_run_resolves_it(tmp_path):
    """dpo.reference auto precomputes when max_steps x batch_size go over the training pairs at least once
    (objective.make_reference): where the plan can count the pairs it plans that mode, a step without the
    reference's forward; below one pass, or with the pairs unread, the per-step reference (here a copy)."""
    from memfit import config
    from memfit.data.formats import data_digest, load_texts
    from memfit.data.pairs import encode_pairs
    from memfit.memory.planner.search import make_estimator
    from memfit.models.loading import load_model_and_tokenizer

    sets = [f"run.work_dir={tmp_path / 'work'}", "data.synthetic_docs=200"]
    cfg = config.load(REPO / "configs" / "dpo-tiny.yaml", sets)
    corpus = load_texts(cfg.data)
    _, tokenizer, _ = load_model_and_tokenizer(cfg, corpus, data_digest(corpus))
    pairs = len(encode_pairs(corpus, tokenizer, cfg.data, 0)[0]["input_ids"])
    train_pairs = pairs - round(pairs * cfg.data.val_fraction)  # the run's split: 10 % held out
    stack = Stack("fp32", cfg.train.micro_batch_size, 1, False)
    modes = {}
    for steps in (train_pairs // cfg.train.batch_size - 1, -(-train_pairs // cfg.train.batch_size)):
        est = make_estimator(config.load(REPO / "configs" / "dpo-tiny.yaml", [*sets, f"train.max_steps={steps}"]),
                             PROFILES["cpu"])
        assert est.dpo_coverage == pytest.approx(steps * cfg.train.batch_size / train_pairs)
        modes[est.dpo_coverage >= 1] = est.estimate(stack, ["none"] * est.n_blocks)
    below, over = modes[False], modes[True]
    assert (below.extra["reference"], over.extra["reference"]) == ("copy", "precompute")
    assert over.peak_bytes < below.peak_bytes and over.step_seconds < below.step_seconds


def test_a_dpo_stack_is_traced_with_the_logits_it_forms_whatever_its_loss_says():
    # A chunked-loss stack would trace no full-vocabulary logits; a DPO step forms them (training/objective.py).
    hf = copy.deepcopy(tiny("llama").config)
    dpo = SimpleNamespace(reference="precompute", loss_type="sigmoid")
    est = Estimator(hf, SEQ, PROFILES["cpu"], dpo=dpo)
    chunked, plain = (Stack("fp32", PAIRS, 1, False, loss=loss) for loss in ("chunked", "plain"))
    assert est.resolved(chunked).loss == "plain"
    assert est.estimate(chunked, ["none"] * 4).peak_bytes == est.estimate(plain, ["none"] * 4).peak_bytes
    sft = Estimator(hf, SEQ, PROFILES["cpu"])
    assert sft.resolved(chunked).loss == "chunked"  # a next-token step keeps its loss
