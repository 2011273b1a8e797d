"""DPO, IPO and SimPO losses and gradients against TRL's own trainers (a test-only oracle) on one tiny batch."""

from __future__ import annotations

import copy

import pytest
import torch
from chat_support import bpe_tokenizer

from memfit.data.synthetic import synthetic_preference_pairs
from memfit.training.objective import DpoObjective, FrozenCopy, Reference

pytestmark = pytest.mark.unit
trl = pytest.importorskip("trl")
PAIRS = 4


def _model(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset

    pairs = synthetic_preference_pairs(16, seed=3)
    tok = bpe_tokenizer([p["prompt"] + p["chosen"] + p["rejected"] for p in pairs], vocab_size=300)
    policy = _model(len(tok), seed=0)
    reference = _model(len(tok), seed=1)  # unlike the policy, so the log-ratios are not zero
    return tok, Dataset.from_list(pairs), policy, reference, tmp_path_factory.mktemp("trl")


def _ours(inputs: dict, loss_type: str, reference=None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    ids, attn, comp = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    labels = ids.masked_fill(comp == 0, -100)
    n = ids.shape[0] // 2
    batch = {"input_ids": ids[:n], "attention_mask": attn[:n], "labels": labels[:n],
             "rejected_input_ids": ids[n:], "rejected_attention_mask": attn[n:], "rejected_labels": labels[n:]}
    objective = DpoObjective(loss_type=loss_type, reference=reference or Reference(), **kw)
    return objective, batch


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _trl_dpo(setup, loss_type: str, beta: float):
    tok, data, policy, reference, root = setup
    args = trl.DPOConfig(output_dir=str(root), loss_type=[loss_type], beta=beta, bf16=False, use_cpu=True,
                         gradient_checkpointing=False, report_to=[], per_device_train_batch_size=PAIRS,
                         max_length=None)
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                             train_dataset=data, processing_class=tok)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    return trainer, inputs, loss.detach(), _grads(trainer.model)


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 2.0), ("ipo", 0.5)])
def test_dpo_loss_and_gradients_equal_trl(setup, loss_type, beta):
    tok, data, policy, reference, _ = setup
    trainer, inputs, trl_loss, trl_grads = _trl_dpo(setup, loss_type, beta)
    model = copy.deepcopy(policy).train()
    objective, batch = _ours(inputs, loss_type, FrozenCopy(reference), beta=beta)
    loss = objective(model, batch)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= 1e-5, (loss.item(), trl_loss.item())
    assert abs(float(trl_loss) - 0.6931) > 1e-3 and float(trl_grads.abs().max()) > 1e-4  # not the trivial point
    torch.testing.assert_close(_grads(model), trl_grads, atol=1e-5, rtol=1e-5)
    ours = objective.pop_metrics()
    theirs = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-5), name
    # As memfit's batches reach the model (blocks_batch): TRL's rows are padded on the right, so without the masks.
    assert all(bool(row[:int(row.sum())].all()) for row in inputs["attention_mask"])  # right padding only
    unmasked = copy.deepcopy(policy).train()
    loss = objective(unmasked, {k: v for k, v in batch.items() if not k.endswith("attention_mask")})
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= 1e-5, (loss.item(), trl_loss.item())
    torch.testing.assert_close(_grads(unmasked), trl_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_loss_and_gradients_equal_trl_cpo(setup, label_smoothing):
    """SimPO as TRL names it: CPOTrainer loss_type simpo with cpo_alpha 0 (no SFT term), reference-free."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok, data, policy, _, root = setup
    beta, gamma = 2.0, 0.5
    args = CPOConfig(output_dir=str(root), loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma,
                     label_smoothing=label_smoothing, bf16=False, use_cpu=True, gradient_checkpointing=False,
                     report_to=[], per_device_train_batch_size=PAIRS, max_length=128)
    trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=data, processing_class=tok)
    rows = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    trainer.model.train()
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(trainer.model, rows)
    trl_loss.backward()

    # The same pairs as CPO tokenized them, laid out as memfit's batch (chosen and rejected padded to one width).
    width = max(rows["chosen_input_ids"].shape[1], rows["rejected_input_ids"].shape[1])

    def side(name: str, pad: int) -> torch.Tensor:
        t = rows[name]
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad)

    batch = {"input_ids": side("chosen_input_ids", 0), "attention_mask": side("chosen_attention_mask", 0),
             "labels": side("chosen_labels", -100), "rejected_input_ids": side("rejected_input_ids", 0),
             "rejected_attention_mask": side("rejected_attention_mask", 0),
             "rejected_labels": side("rejected_labels", -100)}
    model = copy.deepcopy(policy).train()
    objective = DpoObjective(beta=beta, loss_type="simpo", simpo_gamma=gamma, label_smoothing=label_smoothing)
    loss = objective(model, batch)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= 1e-5, (loss.item(), trl_loss.item())
    assert float(_grads(trainer.model).abs().max()) > 1e-4
    torch.testing.assert_close(_grads(model), _grads(trainer.model), atol=1e-5, rtol=1e-5)
    ours = objective.pop_metrics()
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        assert ours[name] == pytest.approx(trl_metrics[name], abs=1e-5), name
