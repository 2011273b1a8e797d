"""Phase 5's memory on the target: the merged model (eval.dtype) plus the largest of its evaluation passes (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

FP32 = 4
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HARNESS_LEN = 2048  # lm-evaluation-harness's HF backend truncates requests to min(model max length, 2048)


@dataclass(frozen=True)
class EvalMemory:
    """Bytes phase 5 holds on the training device: weights, and the peak of each pass run after one another."""

    weights: int  # the merged model in the evaluation dtype (exports are written from fp32 weights in host memory)
    val_loss: int  # validation loss: a micro-batch forward without gradients, its logits and the loss over them
    generation: int  # greedy answers: the KV cache of one prompt + max_new_tokens, the last position's logits
    harness: int  # eval.tasks: eval.batch_size requests of up to HARNESS_LEN tokens, their logits scored
    sets: int  # eval.sets: greedy answers like generation, one a time
    dtype: str = "fp32"

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


def _forward_bytes(hf_config: Any, batch: int, tokens: int, logits_positions: int, item: int = FP32) -> int:
    """A forward without gradients: the residual stream and one block's widest intermediate alive at a time, the
    attention scores of one layer (math kernels materialise them), in the evaluation dtype (`item` bytes), and the
    logits with their log-softmax copy (fp32: the loss upcasts them)."""
    h = int(hf_config.hidden_size)
    inter = int(getattr(hf_config, "intermediate_size", 0) or 4 * h)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    vocab = int(hf_config.vocab_size)
    stream = batch * tokens * (3 * h + 2 * inter) * item
    scores = batch * heads * tokens * tokens * item
    logits = 2 * batch * logits_positions * vocab * FP32
    return stream + scores + logits


def _kv_cache_bytes(hf_config: Any, tokens: int, item: int = FP32) -> int:
    layers = int(getattr(hf_config, "num_hidden_layers", 1) or 1)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    kv = int(getattr(hf_config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(hf_config, "head_dim", 0) or int(hf_config.hidden_size) // heads)
    return 2 * layers * kv * head_dim * tokens * item


def evaluation_memory(hf_config: Any, n_params: int, cfg: Any, dtype: str = "fp32") -> EvalMemory:
    """Pure: phase 5's bytes on the device for a memfit config (its micro-batch, seq_len, eval settings), with the
    model evaluated in `dtype`."""
    item = BYTES[dtype]
    seq, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or HARNESS_LEN)
    gen_tokens = seq + cfg.eval.max_new_tokens  # a prompt as long as a training row, then the new tokens
    generation = _kv_cache_bytes(hf_config, gen_tokens, item) + _forward_bytes(hf_config, 1, seq, 1, item)
    harness = 0
    if cfg.eval.tasks:
        length = min(limit, HARNESS_LEN)
        harness = _forward_bytes(hf_config, cfg.eval.batch_size, length, length, item)
    sets = 0
    if cfg.eval.sets:
        longest = max((s.max_new_tokens or cfg.eval.max_new_tokens) for s in cfg.eval.sets)
        sets = _kv_cache_bytes(hf_config, seq + longest, item) + _forward_bytes(hf_config, 1, seq, 1, item)
    return EvalMemory(weights=n_params * item, val_loss=_forward_bytes(hf_config, micro, seq, seq, item),
                      generation=generation, harness=harness, sets=sets, dtype=dtype)


def resolve_eval_dtype(setting: str, device_type: str, bf16_ok: bool, limit: int | None, fp32_peak: int) -> str:
    """Pure: eval.dtype as phase 5 takes it. auto: fp32 on CPU, where no limit is known, or where the fp32 peak
    fits the limit; else bf16 (fp16 on a device without it), half the weights' bytes."""
    if setting != "auto":
        return setting
    if device_type != "cuda" or limit is None or fp32_peak <= limit:
        return "fp32"
    return "bf16" if bf16_ok else "fp16"


def plan_evaluation(hf_config: Any, n_params: int, cfg: Any, limit: int | None, device_name: str,
                    device_type: str, bf16_ok: bool) -> dict[str, Any]:
    """Phase 5 in the plan: its memory in the dtype eval.dtype resolves to on this target, and one line."""
    fp32 = evaluation_memory(hf_config, n_params, cfg)
    dtype = resolve_eval_dtype(cfg.eval.dtype, device_type, bf16_ok, limit, fp32.peak)
    mem = fp32 if dtype == "fp32" else evaluation_memory(hf_config, n_params, cfg, dtype)
    line = evaluation_line(mem, limit, device_name)
    if dtype != "fp32" and cfg.eval.dtype == "auto":
        line += f" (eval.dtype auto: fp32 would need {fp32.peak / 1e9:.4g} GB)"
    return {**mem.to_dict(), "fits": limit is None or mem.peak <= limit, "line": line}


def evaluation_line(mem: EvalMemory, limit: int | None, device: str) -> str:
    """One line for `memfit plan` and the run's log: phase 5's peak and whether it fits the training budget."""
    text = (f"evaluation (phase 5, {mem.dtype} on {device}): {mem.peak / 1e9:.4g} GB predicted (weights "
            f"{mem.weights / 1e9:.4g} GB + {mem.pass_name} {(mem.peak - mem.weights) / 1e9:.4g} GB)")
    if limit is None:
        return text
    if mem.peak <= limit:
        return f"{text}: fits the {limit / 1e9:.4g} GB limit"
    if mem.weights > limit:
        return (f"{text}: does NOT fit the {limit / 1e9:.4g} GB limit: the {mem.dtype} merged model alone is "
                f"{mem.weights / 1e9:.4g} GB; run phase 5 on a larger device (memfit export CHECKPOINT there)")
    return (f"{text}: does NOT fit the {limit / 1e9:.4g} GB limit: lower eval.batch_size, train.batch_size or "
            "data.seq_len, or run phase 5 on a larger device (memfit export CHECKPOINT there)")
