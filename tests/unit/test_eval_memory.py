"""Phase 5's memory in the plan: the fp32 merged model and its largest evaluation pass, against the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memfit import config
from memfit.memory.estimator.evaluation import evaluation_line, evaluation_memory

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def test_an_8b_model_trained_with_qlora_on_24_gb_cannot_be_evaluated_in_fp32_there():
    cfg = config.load(REPO / "configs" / "llama-3-8b-qlora.yaml", [])
    mem = evaluation_memory(LLAMA3_8B, 8_030_261_248, cfg)
    assert mem.weights == 8_030_261_248 * 4 and mem.peak > mem.weights
    line = evaluation_line(mem, 23_450_000_000, "rtx-4090")
    assert "does NOT fit the 23.45 GB limit: the fp32 merged model alone is 32.12 GB" in line
    assert "fits the 80 GB limit" in evaluation_line(mem, 80_000_000_000, "h100-80gb")


def test_each_pass_grows_with_what_drives_it():
    cfg = config.load(None, ["data.seq_len=512", "train.batch_size=8"])
    base = evaluation_memory(LLAMA3_8B, 1, cfg)
    assert base.harness == 0 and base.sets == 0  # no tasks, no sets: those passes do not run
    tasks = evaluation_memory(LLAMA3_8B, 1, cfg.model_copy(update={"eval": cfg.eval.model_copy(
        update={"tasks": ["hellaswag"], "batch_size": 4})}))
    # The harness scores 4 requests of up to 2048 tokens: their logits alone are 4 x 2048 x 128256 x 4 bytes x 2.
    assert tasks.harness > 2 * 4 * 2048 * 128256 * 4 and tasks.pass_name == "harness"
    longer = evaluation_memory(LLAMA3_8B, 1, config.load(None, ["data.seq_len=1024", "train.batch_size=8"]))
    assert longer.val_loss > 2 * base.val_loss - 1 and longer.generation > base.generation


def test_the_val_loss_pass_is_an_upper_bound_of_a_measured_forward():
    """The val_loss figure of a tiny Llama against what its no-grad forward and loss allocate (tracked)."""
    from memfit.memory.estimator.tracker import StepTracker, total

    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=384)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
    cfg = config.load(None, ["data.seq_len=64", "train.batch_size=8"])
    ids = torch.randint(0, 384, (8, 64))
    tracker = StepTracker()
    with torch.no_grad(), tracker:
        model(input_ids=ids, labels=ids)
    predicted = evaluation_memory(hf, 1, cfg).val_loss
    measured = total(tracker.peak_vec)
    assert measured <= predicted <= 1.5 * measured, (measured, predicted)  # 2.73 MB vs 3.01 MB when written
