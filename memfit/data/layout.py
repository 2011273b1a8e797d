"""data.packing auto: predicted step time per trained token of each layout, from the data's own lengths."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memfit.config.devices import DeviceProfile
from memfit.data.order import grouped_permutation
from memfit.data.packing import _bins, flattened

log = logging.getLogger("memfit.data")
MASK_PASSES = 3  # a materialised mask is written once, read by the forward and again by the backward


@dataclass(frozen=True)
class LayoutCost:
    """One layout's prediction over an epoch of the actual examples (totals, so short and long steps weigh right)."""

    packing: str
    slots: int  # token positions computed, padding included
    real: int  # tokens that are data
    trained: int  # tokens with a loss label
    attention_pairs: float  # (query, key) pairs the attention kernel computes, masked ones included
    mask_bytes: float  # materialised attention-mask bytes
    seconds: float  # predicted compute time of the epoch

    @property
    def s_per_trained_token(self) -> float:
        return self.seconds / max(1, self.trained)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(padding_fraction=round(1 - self.real / max(1, self.slots), 4),
                 us_per_trained_token=float(f"{self.s_per_trained_token * 1e6:.4g}"),
                 predicted_trained_tokens_per_s=round(self.trained / self.seconds, 1) if self.seconds else None)
        return d


def model_costs(hf_config: Any) -> tuple[float, float]:
    """Pure: (matmul FLOPs per computed token, forward + backward; FLOPs per attention (query, key) pair, all
    layers). The LM head counts: it computes on every position, padding included."""
    h = int(hf_config.hidden_size)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or getattr(hf_config, "n_layer", 1))
    inter = int(getattr(hf_config, "intermediate_size", 0) or 4 * h)
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    kv = int(getattr(hf_config, "num_key_value_heads", 0) or heads)
    mlp = 2 if getattr(hf_config, "model_type", "") in ("gpt2", "gpt_neox", "falcon", "starcoder2") else 3
    per_layer = 2 * h * h + 2 * h * h * kv // heads + mlp * h * inter
    params = layers * per_layer + h * int(hf_config.vocab_size)
    return 6.0 * params, 12.0 * layers * h


def predict(lengths: list[int], trained: list[int], seq_len: int, micro_batch: int, hf_config: Any,
            profile: DeviceProfile, attn_implementation: str, allow_blocks: bool, flatten: bool,
            group_by_length: bool = True, seed: int = 0, dtype: str = "float32", padding_mask: bool = False
            ) -> list[LayoutCost]:
    """Pure: each candidate layout's epoch cost, cheapest per trained token first.

    compute time = (slots x matmul FLOPs per token + attention pairs x FLOPs per pair) / the device's matmul
    FLOP/s + materialised-mask bytes x MASK_PASSES / memory bandwidth. A causal kernel without a mask computes
    half the square; with a materialised mask (padding, packed examples on SDPA/eager) all of it; varlen flash
    attention only each example's own triangle. `flatten`: padding-free micro-batches run as one joined row
    (data.flatten as the loop resolves it). One padded example a row runs causal without its mask (right padding),
    unless `padding_mask` (an MoE's load-balancing loss reads it: models/experts.keeps_padding_mask)."""
    per_token, per_pair = model_costs(hf_config)
    flops, bandwidth = profile.flops_per_s(dtype), profile.bandwidth
    flash = attn_implementation.startswith("flash")
    mask_item = 4 if attn_implementation == "eager" else 1  # additive float mask vs boolean
    n_real, n_trained = sum(lengths), sum(trained)
    out: list[LayoutCost] = []

    def cost(packing: str, slots: float, pairs: float, mask: float, real: int = n_real, tr: int = n_trained) -> None:
        seconds = (slots * per_token + pairs * per_pair) / flops + mask * MASK_PASSES / bandwidth
        out.append(LayoutCost(packing, int(slots), real, tr, pairs, mask, seconds))

    # none: one example a row in the loop's order (length-grouped or not), each micro-batch cut to its longest.
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    if group_by_length:
        order = grouped_permutation(order, lengths, micro_batch)
    slots = pairs = mask = 0.0
    for i in range(0, len(order), micro_batch):
        batch = [lengths[j] for j in order[i:i + micro_batch]]
        longest = max(batch)
        slots += len(batch) * longest
        masked = padding_mask and not flash and any(n < longest for n in batch)
        pairs += len(batch) * longest * longest * (1.0 if masked else 0.5)
        mask += len(batch) * longest * longest * mask_item if masked else 0.0
    cost("none", slots, pairs, mask)
    # padding_free: whole examples packed into rows of seq_len; flattened: a micro-batch's rows as one row.
    rows = [sum(lengths[i] for i in members) for members in _bins(lengths, seq_len)]
    if flash:
        cost("padding_free", n_real if flatten else len(rows) * seq_len, sum(n * n * 0.5 for n in lengths), 0.0)
    elif flatten:
        pairs = mask = 0.0
        for i in range(0, len(rows), micro_batch):
            t = sum(rows[i:i + micro_batch])
            pairs, mask = pairs + t * t, mask + t * t * mask_item
        cost("padding_free", n_real, pairs, mask)
    else:
        cost("padding_free", len(rows) * seq_len, len(rows) * seq_len ** 2, len(rows) * seq_len ** 2 * mask_item)
    if allow_blocks:  # every token in a block, all trained when the objective is plain language modelling
        n_blocks = max(1, n_real // seq_len)
        cost("blocks", n_blocks * seq_len, n_blocks * seq_len * seq_len * 0.5, 0.0, n_blocks * seq_len,
             int(n_trained * n_blocks * seq_len / max(1, n_real)))
    return sorted(out, key=lambda c: c.s_per_trained_token)


def resolve_packing(cfg: Any, corpus: Any, tokenizer: Any, hf_config: Any, profile: DeviceProfile,
                    attn_implementation: str) -> tuple[str, list[LayoutCost]]:
    """data.packing auto made concrete: (the layout with the least predicted time per trained token, every
    candidate's prediction). blocks is a candidate only for plain text trained on every token: elsewhere it would
    let examples attend to each other and change what is learnt."""
    from memfit.data.masking import encode_examples

    encoded = encode_examples(corpus, tokenizer, cfg.data)
    lengths, trained = example_lengths(encoded, corpus.origins, cfg.data)
    return choose_packing(cfg, lengths, trained, corpus.format, hf_config, profile, attn_implementation)


def example_lengths(encoded: list[Any], origins: list[tuple[str, int]], data: Any) -> tuple[list[int], list[int]]:
    """(tokens, trained tokens) of each example as packed rows would hold it (overlong ones cut or dropped)."""
    from memfit.data.masking import fit_overlong

    kept, _, _ = fit_overlong(encoded, origins, data.seq_len,
                              "truncate" if data.overlong == "error" else data.overlong, "auto")
    return [len(ids) for ids, _ in kept], [sum(1 for t in labels[1:] if t != -100) for _, labels in kept]


def choose_packing(cfg: Any, lengths: list[int], trained: list[int], fmt: str, hf_config: Any,
                   profile: DeviceProfile, attn_implementation: str) -> tuple[str, list[LayoutCost]]:
    """resolve_packing from the examples' lengths and trained tokens (however they were read)."""
    from memfit.models.experts import keeps_padding_mask

    data = cfg.data
    dtype = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "fp16-mixed": "float16"}.get(
        cfg.train.precision, "float32")
    costs = predict(lengths, trained, data.seq_len, cfg.train.micro_batch_size, hf_config, profile,
                    attn_implementation, allow_blocks=fmt == "text" and data.train_on == "all",
                    flatten=flattened(data, True, attn_implementation), group_by_length=data.group_by_length,
                    seed=cfg.train.seed, dtype=dtype, padding_mask=keeps_padding_mask(hf_config))
    log.info("data.packing auto: %s on %s (%s)", costs[0].packing, profile.name, ", ".join(
        f"{c.packing} {c.s_per_trained_token * 1e6:.2f} us/trained token" for c in costs))
    return costs[0].packing, costs


def format_layouts(chosen: str, rows: list[dict[str, Any]]) -> str:
    """The candidates of data.packing auto as a Markdown table (memfit plan)."""
    lines = [f"\ndata.packing auto: {chosen} (predicted from the data's lengths, the model's shape and kernel)",
             "| packing | padding computed | us / trained token | predicted trained tokens/s |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['packing']} | {r['padding_fraction']:.1%} | {r['us_per_trained_token']:.3g} | "
                     f"{r['predicted_trained_tokens_per_s'] or 0:,.0f} |")
    return "\n".join(lines)
