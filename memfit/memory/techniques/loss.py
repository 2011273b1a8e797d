"""The loss policy: how a batch's training loss is computed from the model (one place for loop, eval and estimator)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import ConfigError

log = logging.getLogger(__name__)

# A batch is a dict of tensors: input_ids and labels always ([batch, seq]; labels -100 where nothing is learned),
# attention_mask / position_ids when the data's packing mode needs them.
Batch = dict[str, torch.Tensor]


def blocks_batch(blocks: torch.Tensor, idx: torch.Tensor | slice, device: torch.device | None = None,
                 fields: dict[str, torch.Tensor] | None = None, attn_implementation: str = "sdpa",
                 lengths: list[int] | None = None, padding_mask: bool = False) -> Batch:
    """The batch of rows `idx`: input_ids, and labels (the inputs themselves for plain text blocks, else the data's
    with -100 on untrained tokens); the packing mode's position_ids / attention_mask come along from `fields`.
    `lengths` (padding-free packs, data.flatten): each row's real tokens; the rows are joined into one sequence
    without their tail padding (a new example still starts at position 0, and its first label is -100).

    One padded example (or pair) a row is cut to the batch's longest row, and its 2-D padding mask is dropped: the
    padding is on the right, so under the causal mask no real token ever attends to it, and the logits of the real
    tokens are the same without it (bitwise on CPU; the gradients to fp32 rounding: tests/unit/test_padding_mask.py).
    Without it attention runs causal (SDPA's flash kernel on CUDA), with no [rows, 1, seq, seq] mask, its per-layer
    copies, or transformers' reads of it to the host. `padding_mask`: keep it, for a model whose loss counts the
    real tokens by it (an MoE's load-balancing loss: models/experts.keeps_padding_mask)."""
    fields = fields or {}
    rows = {"input_ids": blocks[idx], **{k: v[idx] for k, v in fields.items()}}
    if lengths is not None and "position_ids" in rows:
        rows = {k: torch.cat([v[r, :n] for r, n in enumerate(lengths)])[None] for k, v in rows.items()}
    if "attention_mask" in rows:  # one padded example (or pair) a row: cut the batch to its longest (on the host)
        longest = max(int(v.sum(-1).max()) for k, v in rows.items() if k.endswith("attention_mask"))
        rows = {k: v[:, :longest] if v.dim() == 2 else v for k, v in rows.items()
                if padding_mask or not k.endswith("attention_mask")}
    if device is not None:
        rows = {k: v.to(device, non_blocking=True) for k, v in rows.items()}
    rows.setdefault("labels", rows["input_ids"])
    if "position_ids" in rows:  # padding-free packs: no attention across the examples of a row
        from memfit.data.packing import packed_attention_mask

        mask = packed_attention_mask(rows["position_ids"], attn_implementation, torch.float32)
        if mask is not None:
            rows["attention_mask"] = mask
    return rows


def model_inputs(batch: Batch) -> Batch:
    """What the model's forward takes of a batch (a preference batch's rejected side and reference log-probs are
    the objective's: the next-token loss of such a batch is that of its chosen side)."""
    return {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask", "position_ids")}


def trained_tokens(batch: Batch) -> int:
    """Tokens whose prediction is trained (labels shifted by one, as the causal-LM loss does)."""
    return int((batch["labels"][..., 1:] != -100).sum())


class LossPolicy(Protocol):
    """Mean next-token loss over the batch's trained tokens."""

    name: str

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...


class PlainLoss:
    """The model's own loss: full [batch, seq, vocab] logits, then cross-entropy (what transformers does)."""

    name = "plain"
    # An MoE model's last (router aux loss, router logits), detached, for the metrics interval; None when dense.
    last_routing: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(**model_inputs(batch))
        aux = getattr(out, "aux_loss", None)  # MoE with output_router_logits: already in out.loss (its coef)
        if aux is not None:
            self.last_routing = (aux.detach(), tuple(r.detach() for r in out.router_logits or ()))
        return out.loss


# The vocabulary size from which `memory.loss: auto` chunks: there the fp32 logits of a sequence ([seq, vocab] x 4
# bytes, their gradient as much again) outweigh a decoder block's activations for common hidden sizes.
CHUNKED_FROM_VOCAB = 32768


def _causal_lm(model: nn.Module) -> nn.Module:
    # PEFT keeps the transformers model inside; the decoder and head are that model's.
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _refuse_wrapped(model: nn.Module) -> None:
    # DDP and FSDP2 act in the root module's forward (gradient sync, unsharding): calling the decoder inside
    # them directly would bypass that.
    from torch.nn.parallel import DistributedDataParallel

    wrapped = isinstance(model, DistributedDataParallel)
    try:
        from torch.distributed.fsdp import FSDPModule

        wrapped = wrapped or isinstance(model, FSDPModule)
    except ImportError:  # pragma: no cover - torch builds without distributed
        pass
    if wrapped:
        raise ConfigError("memory.loss: chunked runs in one process only (DDP/FSDP2 need the model's own "
                          "forward); set memory.loss to plain or auto")


def _head_ce_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk through a wrapped head (adapters, quantized): its own forward, logits
    upcast to fp32 as transformers does (recomputed in backward under torch.utils.checkpoint)."""
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # What F.linear would compute in here: autocast's dtype when it is on (the trainer's mixed precision).
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of one chunk of tokens through a plain linear head, logits in fp32.

    Neither pass keeps more than one fp32 [chunk, vocab] buffer: forward turns the logits into their
    log-sum-exp in place and saves only that ([chunk] floats); backward recomputes the logits and turns that same
    buffer into their gradient (softmax minus one-hot) in place, where autograd through log_softmax would hold
    the log-probabilities, their gradient and the logits' gradient at once.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor) -> torch.Tensor:
        dtype = _matmul_dtype(hidden, weight)
        logits = _chunk_logits(hidden, weight, bias, dtype)
        valid = labels != -100
        target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
        top = logits.amax(dim=1)
        lse = logits.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.dtype = dtype
        return torch.where(valid, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        dtype = ctx.dtype
        grad = _chunk_logits(hidden, weight, bias, dtype).sub_(lse[:, None]).exp_()  # the softmax
        valid = labels != -100
        rows = torch.arange(labels.shape[0], device=labels.device)
        grad[rows, labels.clamp(min=0)] -= valid.to(grad.dtype)
        grad.mul_(torch.where(valid, grad_loss, 0.0)[:, None])  # ignored tokens get no gradient
        w = weight.to(dtype)
        d_hidden = None
        if ctx.needs_input_grad[0]:  # slice by slice: no compute-dtype copy of the whole fp32 gradient
            d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            for g, out in zip(grad.split(SLICE_ROWS), d_hidden.split(SLICE_ROWS), strict=True):
                out.copy_(g.to(dtype) @ w)
        d_weight = d_bias = None
        if ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]):  # a trained head
            grad = grad.to(dtype)  # the fp32 buffer goes as the compute-dtype copy is made
            d_weight = (grad.t() @ hidden.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            d_bias = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return d_hidden, d_weight, d_bias, None


# Rows of a chunk handled at a time where a 16-bit [rows, vocab] copy is made of (or for) its fp32 logits, so
# that copy stays a sliver beside the fp32 buffer (128 rows of a 128 K vocabulary: 31 MiB in bf16).
SLICE_ROWS = 128


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The chunk's logits in fp32, computed in `dtype`; a 16-bit matmul fills the fp32 buffer slice by slice."""
    b = None if bias is None else bias.to(dtype)
    w = weight.to(dtype)
    if dtype == torch.float32:
        return F.linear(hidden.to(dtype), w, b)
    out = torch.empty((hidden.shape[0], w.shape[0]), dtype=torch.float32, device=hidden.device)
    for h, o in zip(hidden.split(SLICE_ROWS), out.split(SLICE_ROWS), strict=True):
        o.copy_(F.linear(h.to(dtype), w, b))
    return out


def _chunk_ce_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # A plain head runs functionally: the module called once per chunk would confuse per-module hooks (the
    # memory tracker's); a wrapped head keeps its own forward, recomputed under checkpoint.
    if type(head) is nn.Linear:
        if torch.is_grad_enabled():
            return _LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels)
        return F.cross_entropy(_chunk_logits(hidden, head.weight, head.bias, _matmul_dtype(hidden, head.weight)),
                               labels, ignore_index=-100, reduction="sum")
    if torch.is_grad_enabled():
        return checkpoint(_head_ce_sum, head, hidden, labels, use_reentrant=False)
    return _head_ce_sum(head, hidden, labels)


class ChunkedLoss:
    """The LM head and cross-entropy per chunk of tokens, each chunk recomputed in backward.

    The decoder gives the final hidden states; each chunk's logits exist only inside its own forward (and again
    inside its backward, under torch.utils.checkpoint), so no [batch, seq, vocab] tensor is ever alive. The
    labels are shifted as transformers shifts them (the last position learns nothing) and -100 is ignored.
    (Liger's fused kernel, which needs no recompute, is memory.loss fused: fused_loss.py.)
    """

    name = "chunked"

    def __init__(self, chunk_tokens: int = 1024) -> None:
        self.chunk_tokens = chunk_tokens

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        _refuse_wrapped(model)
        lm = _causal_lm(model)
        head = lm.get_output_embeddings()
        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state
        labels = batch["labels"]
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        total = flat.new_zeros((), dtype=torch.float32)
        for h, y in zip(flat.split(self.chunk_tokens), shifted.split(self.chunk_tokens), strict=True):
            total = total + _chunk_ce_sum(head, h, y)
        return total / (shifted != -100).sum().clamp(min=1)


class FusedLoss:
    """`memory.loss: fused`: the decoder's hidden states through the head and cross-entropy in one fused op (no
    [batch, seq, vocab] logits, no recompute; fused_loss.py). `emulate`: its plain-torch twin (the estimator's
    fake tensors). Where Liger cannot run (CPU, not installed, a wrapped head) one line says why, and the next
    best loss runs instead."""

    name = "fused"

    def __init__(self, chunk_tokens: int = 1024, world_size: int = 1, emulate: bool = False) -> None:
        self.chunk_tokens, self.world_size, self.emulate = chunk_tokens, world_size, emulate
        self.fallback: LossPolicy | None = None

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        from memfit.memory.techniques.fused_loss import fused_head_loss, fused_unavailable

        if self.fallback is not None:
            return self.fallback(model, batch)
        _refuse_wrapped(model)
        lm = _causal_lm(model)
        head = lm.get_output_embeddings()
        if type(head) is not nn.Linear:  # adapters or a quantized layer on the head: Liger takes a weight matrix
            why = f"memory.loss: fused needs a plain linear head; this head is a {type(head).__name__}"
        else:
            why = None if self.emulate else fused_unavailable(head.weight.device.type)
        if why is not None:
            name = next_best(head.weight.shape[0], self.world_size)
            log.warning("%s: the %s loss instead", why, name)
            self.fallback = loss_by_name(name, self.chunk_tokens)
            return self.fallback(model, batch)
        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state
        labels = batch["labels"]
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1).reshape(-1)
        return fused_head_loss(head, hidden.reshape(-1, hidden.shape[-1]), shifted, self.emulate)


def next_best(vocab_size: int, world_size: int = 1) -> str:
    """The loss taken where fused cannot run: chunked where auto would chunk (large vocabularies), else plain."""
    return "chunked" if vocab_size >= CHUNKED_FROM_VOCAB and world_size == 1 else "plain"


def resolve_loss(setting: str, vocab_size: int, world_size: int = 1, device_type: str = "cpu") -> str:
    """`memory.loss` as run on `device_type`: auto is chunked from CHUNKED_FROM_VOCAB entries on, in one process
    (fused instead on CUDA where liger-kernel is installed); fused off CUDA is the next best."""
    from memfit.memory.techniques.fused_loss import fused_unavailable

    if setting == "fused" and device_type != "cuda":
        return next_best(vocab_size, world_size)
    if setting != "auto":
        return setting
    chosen = next_best(vocab_size, world_size)
    return "fused" if chosen == "chunked" and fused_unavailable(device_type) is None else chosen


def loss_by_name(name: str, chunk_tokens: int = 1024, world_size: int = 1, emulate: bool = False) -> LossPolicy:
    """The loss policy `name`; emulate: the fused loss as its plain-torch twin (the estimator's fake tensors)."""
    if name == "plain":
        return PlainLoss()
    if name == "chunked":
        return ChunkedLoss(chunk_tokens)
    if name == "fused":
        return FusedLoss(chunk_tokens, world_size, emulate=emulate)
    raise ConfigError(f"memory.loss: unknown loss {name!r}; choose auto, plain, chunked or fused")


class AutoLoss:
    """`memory.loss: auto`: plain or chunked by the vocabulary of the model it is given (resolved once)."""

    name = "auto"

    def __init__(self, chunk_tokens: int, world_size: int) -> None:
        self.chunk_tokens, self.world_size = chunk_tokens, world_size
        self.chosen: LossPolicy | None = None

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if self.chosen is None:
            head = _causal_lm(getattr(model, "module", model)).get_output_embeddings()
            device = head.weight.device.type
            self.chosen = loss_by_name(resolve_loss("auto", head.weight.shape[0], self.world_size, device),
                                       self.chunk_tokens, self.world_size)
        return self.chosen(model, batch)


def make_loss(cfg: Any | None = None, loss: str | None = None) -> LossPolicy:
    """The run's loss policy (the one place a loss is built): `loss` as planned (the plan's), else memory.loss;
    plain without a config."""
    if cfg is None:
        return PlainLoss()
    m = cfg.memory
    name = loss or m.loss
    if name == "auto":
        return AutoLoss(m.loss_chunk_tokens, cfg.distributed.world_size)
    return loss_by_name(name, m.loss_chunk_tokens, cfg.distributed.world_size)
