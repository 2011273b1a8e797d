"""Phase 5's memory on the target: the merged fp32 model plus the largest of its evaluation passes (pure math)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

FP32 = 4
HARNESS_LEN = 2048  # lm-evaluation-harness's HF backend truncates requests to min(model max length, 2048)


@dataclass(frozen=True)
class EvalMemory:
    """Bytes phase 5 holds on the training device: weights, and the peak of each pass run after one another."""

    weights: int  # the merged model in fp32 (exports and evaluation are fp32)
    val_loss: int  # validation loss: a micro-batch forward without gradients, its logits and the loss over them
    generation: int  # greedy answers: the KV cache of one prompt + max_new_tokens, the last position's logits
    harness: int  # eval.tasks: eval.batch_size requests of up to HARNESS_LEN tokens, their logits scored
    sets: int  # eval.sets: greedy answers like generation, one a time

    @property
    def peak(self) -> int:
        return self.weights + max(self.val_loss, self.generation, self.harness, self.sets)

    @property
    def pass_name(self) -> str:
        passes = {"val_loss": self.val_loss, "generation": self.generation, "harness": self.harness,
                  "sets": self.sets}
        return max(passes, key=lambda k: passes[k])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak, "largest_pass": self.pass_name}


def _forward_bytes(hf_config: Any, batch: int, tokens: int, logits_positions: int) -> int:
    """A forward without gradients: the residual stream and one block's widest intermediate alive at a time, the
    attention scores of one layer (math kernels materialise them), and the logits with their log-softmax copy."""
    h = int(hf_config.hidden_size)
    inter = int(getattr(hf_config, "intermediate_size", 0) or 4 * h)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    vocab = int(hf_config.vocab_size)
    stream = batch * tokens * (3 * h + 2 * inter) * FP32
    scores = batch * heads * tokens * tokens * FP32
    logits = 2 * batch * logits_positions * vocab * FP32
    return stream + scores + logits


def _kv_cache_bytes(hf_config: Any, tokens: int) -> int:
    layers = int(getattr(hf_config, "num_hidden_layers", 1) or 1)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    kv = int(getattr(hf_config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(hf_config, "head_dim", 0) or int(hf_config.hidden_size) // heads)
    return 2 * layers * kv * head_dim * tokens * FP32


def evaluation_memory(hf_config: Any, n_params: int, cfg: Any) -> EvalMemory:
    """Pure: phase 5's bytes on the device for a memfit config (its micro-batch, seq_len, eval settings)."""
    seq, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or HARNESS_LEN)
    gen_tokens = seq + cfg.eval.max_new_tokens  # a prompt as long as a training row, then the new tokens
    generation = _kv_cache_bytes(hf_config, gen_tokens) + _forward_bytes(hf_config, 1, seq, 1)
    harness = 0
    if cfg.eval.tasks:
        length = min(limit, HARNESS_LEN)
        harness = _forward_bytes(hf_config, cfg.eval.batch_size, length, length)
    sets = 0
    if cfg.eval.sets:
        longest = max((s.max_new_tokens or cfg.eval.max_new_tokens) for s in cfg.eval.sets)
        sets = _kv_cache_bytes(hf_config, seq + longest) + _forward_bytes(hf_config, 1, seq, 1)
    return EvalMemory(weights=n_params * FP32, val_loss=_forward_bytes(hf_config, micro, seq, seq),
                      generation=generation, harness=harness, sets=sets)


def evaluation_line(mem: EvalMemory, limit: int | None, device: str) -> str:
    """One line for `memfit plan` and the run's log: phase 5's peak and whether it fits the training budget."""
    text = (f"evaluation (phase 5, fp32 on {device}): {mem.peak / 1e9:.4g} GB predicted (weights "
            f"{mem.weights / 1e9:.4g} GB + {mem.pass_name} {(mem.peak - mem.weights) / 1e9:.4g} GB)")
    if limit is None:
        return text
    if mem.peak <= limit:
        return f"{text}: fits the {limit / 1e9:.4g} GB limit"
    if mem.weights > limit:
        return (f"{text}: does NOT fit the {limit / 1e9:.4g} GB limit: the fp32 merged model alone is "
                f"{mem.weights / 1e9:.4g} GB; run phase 5 on a larger device (memfit export CHECKPOINT there)")
    return (f"{text}: does NOT fit the {limit / 1e9:.4g} GB limit: lower eval.batch_size, train.batch_size or "
            "data.seq_len, or run phase 5 on a larger device (memfit export CHECKPOINT there)")
