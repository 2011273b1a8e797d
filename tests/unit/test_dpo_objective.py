"""The DPO objective without TRL: reference choice, metric bookkeeping, and what an evaluation logs."""

from __future__ import annotations

import pytest
import torch

from memfit.errors import ConfigError
from memfit.training.objective import DpoObjective, FrozenCopy, make_reference

pytestmark = pytest.mark.unit


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


def _batch(pairs: int = 3, width: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for side in ("", "rejected_"):
        ids = torch.randint(1, 64, (pairs, width), generator=g)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt
        out |= {side + "input_ids": ids, side + "labels": labels, side + "attention_mask": torch.ones_like(ids)}
    return out


class _Tracker:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


def test_adapter_off_needs_adapters_and_auto_picks_by_model():
    model = _model()
    with pytest.raises(ConfigError, match="dpo.reference: adapter_off needs LoRA adapters"):
        make_reference("adapter_off", "sigmoid", model)
    assert make_reference("auto", "sigmoid", model).name == "copy"
    assert make_reference("copy", "simpo", model).name == "none"  # simpo is reference-free


def test_a_fresh_copy_gives_log2_and_the_copy_is_frozen_apart_from_the_model():
    model = _model()
    reference = FrozenCopy(model)
    objective = DpoObjective(reference=reference)
    loss = objective(model, _batch())
    assert loss.item() == pytest.approx(0.693147, abs=1e-6)  # policy == reference: every margin is 0
    assert not any(p.requires_grad for p in reference.model.parameters())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), reference.model.parameters(),
                                                            strict=True))
    metrics = objective.pop_metrics()
    assert metrics["rewards/accuracies"] == 0.0 and metrics["rewards/margins"] == 0.0  # a tie is not a win
    assert objective.pop_metrics() == {}  # popped once


def test_an_evaluation_logs_val_metrics_and_leaves_the_training_sums_alone():
    model = _model()
    objective = DpoObjective(loss_type="simpo", beta=2.0)
    objective(model, _batch(pairs=2))
    tracker = _Tracker()
    with torch.no_grad(), objective.measuring(tracker, step=5):
        objective(model, _batch(pairs=3))
    (logged, step), = tracker.logged
    assert step == 5 and {"val_dpo_loss", "val_rewards/accuracies", "val_preference_accuracy"} <= set(logged)
    train = objective.pop_metrics()  # the training call's sums survived the evaluation
    assert set(train) == {k.removeprefix("val_") for k in logged} and train != {k.removeprefix("val_"): v
                                                                                 for k, v in logged.items()}


def test_an_evaluation_returns_the_chosen_next_token_loss_as_phase_5_does():
    from memfit.memory.techniques.loss import PlainLoss

    model = _model()
    objective, batch = DpoObjective(reference=FrozenCopy(model)), _batch()
    with torch.no_grad(), objective.measuring(_Tracker(), step=0):
        val = objective(model, batch).item()
    with torch.no_grad():
        assert val == pytest.approx(PlainLoss()(model, batch).item(), abs=1e-5)  # the chosen side alone


def test_a_dpo_run_is_resumed_only_with_the_same_dpo_settings():
    from memfit import config
    from memfit.run_context import run_identity

    sft = run_identity(config.load(None))
    assert "objective" not in sft["train"] and "dpo" not in sft  # SFT checkpoints written before DPO still resume
    assert "chosen_field" not in sft["data"]
    dpo = run_identity(config.load(None, ["train.objective=dpo", "dpo.beta=0.2"]))
    assert dpo["train"]["objective"] == "dpo" and dpo["dpo"]["beta"] == 0.2


def test_two_micro_batches_give_the_gradient_of_one_batch():
    """Accumulation (each micro-batch's mean loss / steps, as the strategies scale it) matches the whole batch."""
    batch = _batch(pairs=4)
    grads = []
    for parts in (1, 2):
        model = _model()
        objective = DpoObjective(reference=FrozenCopy(_model()), beta=0.5)
        model.model.embed_tokens.weight.data.mul_(1.5)  # unlike the reference
        for i in range(parts):
            rows = slice(i * 4 // parts, (i + 1) * 4 // parts)
            (objective(model, {k: v[rows] for k, v in batch.items()}) / parts).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float(grads[0].abs().max()) > 1e-4
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def _reference_logps(model, batch):
    """Summed trained-token log-probs computed the plain way: every position's logits, cut, log-softmax, gather."""
    from memfit.training.objective import concatenated

    both = concatenated(batch)
    labels = both.pop("labels")
    logp = torch.log_softmax(model(**both).logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * (labels[:, 1:] != -100)).sum(-1)


def test_the_head_runs_only_from_the_first_completion_and_the_log_probs_are_unchanged():
    from memfit.training.objective import policy_logps

    model = _model().eval()
    batch = _batch(width=12)
    batch["labels"][1, :7] = -100  # a longer prompt: the shortest one (4) still decides where the head starts
    batch["rejected_labels"][:, :6] = -100
    seen = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    summed, counts = policy_logps(model, batch)
    assert seen == [12 - 3]  # label 4 is predicted at position 3: the prompt's first three positions skip the head
    assert torch.allclose(summed, _reference_logps(model, batch), atol=1e-5, rtol=0)
    assert counts.tolist() == [8, 5, 8, 6, 6, 6]


def test_rows_without_a_completion_and_models_without_logits_to_keep_get_every_logit():
    from memfit.training.objective import first_predicting, policy_logps

    assert first_predicting(torch.full((2, 5), -100)) == 0  # nothing trained: nothing to cut
    assert first_predicting(torch.tensor([[-100] * 5, [-100, -100, -100, 7, 8]])) == 2  # the empty row is ignored

    class NoKeep(torch.nn.Module):  # a causal LM whose forward takes no logits_to_keep (remote code, say)
        def __init__(self) -> None:
            super().__init__()
            self.inner = _model().eval()

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    model = NoKeep()
    summed, _ = policy_logps(model, _batch())
    assert torch.allclose(summed, _reference_logps(model.inner, _batch()), atol=1e-5, rtol=0)
