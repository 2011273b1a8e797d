"""Estimator: a training step traced on fake tensors (nothing allocated), composed to full depth."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from memfit.config.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.memory.estimator.clock import emulated_step_seconds, host_copy_seconds, op_cost_model
from memfit.memory.estimator.compose import (
    PROXY_BLOCKS,
    Estimate,
    KindTrace,
    Stack,
    StaticTrace,
    compose,
    extrapolate_static,
)
from memfit.memory.estimator.fake_model import fake_model, fake_tracing, n_blocks_of, no_init, with_depth
from memfit.memory.estimator.step import host_bytes as optimizer_host_bytes
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step
from memfit.memory.estimator.tracker import Segment, StepTracker
from memfit.memory.techniques.policies import BLOCK_KINDS, OFFLOAD_EMULATION, assign_blocks, find_blocks
from memfit.models.loading import forward_error

log = logging.getLogger("memfit.memory")


class Estimator:
    """Estimates for one model and workload on one target device; traces are cached per candidate.

    Each decoder-block kind (none, selective, full, offload) is traced on a proxy with at most three blocks;
    the full-depth model is built on fake tensors only for its weights and optimizer step. Any assignment of
    kinds to blocks is then composed (memfit.memory.estimator.compose) without tracing again.
    """

    def __init__(self, hf_config: Any, seq_len: int, profile: DeviceProfile, *, lora_cfg: Any | None = None,
                 save_ops: Sequence[str] = (), block_class: str | None = None, weight_decay: float = 0.01,
                 max_grad_norm: float | None = 1.0, anchor_micro_batch: int | None = None,
                 loss_chunk_tokens: int = 1024, dpo: Any | None = None, attention_mask: bool = False,
                 flattened: bool = False, dpo_logits_keep: int | None = None,
                 dpo_coverage: float | None = None, dpo_sharded: bool = False) -> None:
        self.hf_config = hf_config
        # The run's batches carry an explicit [rows, 1, seq, seq] mask (padding per batch, padding-free packs on a
        # kernel without varlen): traced with one, for SDPA's copy of it in each layer (see MaskedLoss).
        self.attention_mask = attention_mask
        # data.flatten true on such a kernel: a micro-batch is one joined row, its mask (micro x seq)^2.
        self.flattened = flattened
        # train.objective dpo (its config section): a micro-batch of pairs is twice the rows, plus the reference.
        self.dpo = dpo
        self.rows_per_example = 2 if dpo is not None else 1
        # DPO's head runs from the first position that predicts a completion token: the positions it keeps in the
        # worst batch of the data (its longest pair beside its shortest prompt); None: every position.
        self.dpo_logits_keep = dpo_logits_keep
        self.dpo_coverage = dpo_coverage  # passes over the training pairs, where read: dpo.reference auto's rule
        self.dpo_sharded = dpo_sharded  # parameters split over the ranks (FSDP2, ZeRO-3): auto does not copy them
        self.n_blocks = n_blocks_of(hf_config)
        self.seq_len = seq_len
        self.profile = profile
        self.lora_cfg = lora_cfg
        self.save_ops = tuple(save_ops)
        self.block_class = block_class
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        # Micro-batches strictly between 1 and this one are interpolated from traces at both ends: every
        # activation is linear in the micro-batch, and a segment's peak (a max of linear terms) is convex,
        # so the interpolation never underestimates.
        self.anchor_micro_batch = anchor_micro_batch
        self.loss_chunk_tokens = loss_chunk_tokens
        self._statics: dict[tuple, StaticTrace] = {}
        self._traces: dict[tuple, KindTrace] = {}
        self.trace_seconds = 0.0
        self._base: torch.nn.Module | None = None
        # Several ranks (for_ranks): each traces its share of a micro-batch, then the planner's sharding applies.
        self.world_size = 1
        self.share: Callable[[Estimate], Estimate] | None = None

    # -- tracing -----------------------------------------------------------------------------------------
    def _build(self, n: int, stack: Stack, mode: Any) -> torch.nn.Module:
        return fake_model(with_depth(self.hf_config, n), stack.precision,
                          self.lora_cfg if stack.lora else None, mode, stack.quantize if stack.lora else "none",
                          stack.lean_layers)

    def at_seq_len(self, seq_len: int) -> Estimator:
        """The same model and target at another sequence length (the weights' and optimizer's trace reused)."""
        if seq_len == self.seq_len:
            return self
        other = copy.copy(self)
        other.seq_len, other._traces = seq_len, {}
        other.dpo_logits_keep = None  # the data's prompts say nothing of rows of another length: every position
        return other

    def for_ranks(self, world_size: int, share: Callable[[Estimate], Estimate]) -> Estimator:
        """The same model and target, each estimate one rank's of `world_size`: the rank's share of every
        micro-batch traced (the stack keeps the global micro-batch), then `share` (the planner's sharding:
        planner/sharding.py) turns one process's bytes into that rank's."""
        other = copy.copy(self)  # the traces are shared: a rank's micro-batch is just another traced size
        other.world_size, other.share = world_size, share
        return other

    def retraced(self, estimate: Estimate, **changes: Any) -> Estimate:
        """`estimate`'s step (its stack as traced: a rank's rows of each micro-batch) estimated again with `changes`
        to the stack: the planner's DeepSpeed rows under bf16-mixed, the model held in bf16 (planner/sharding.py)."""
        rows = estimate.stack.micro_batch_size * self.world_size  # estimate() divides the global micro-batch
        return self.estimate(replace(estimate.stack, micro_batch_size=rows, **changes), estimate.kinds)

    def static(self, stack: Stack) -> StaticTrace:
        stack = self.resolved(stack)  # the planner asks for weights alone before any estimate resolves `auto`
        key = (stack.precision, stack.lora, stack.quantize, stack.optimizer, stack.optimizer_in_backward)
        if key not in self._statics:
            t0 = time.perf_counter()
            self._statics[key] = self._trace_static(stack)
            self.trace_seconds += time.perf_counter() - t0
        return self._statics[key]

    def base_model(self) -> torch.nn.Module:
        """The base model at full depth on the meta device (shapes only), built once: parameter counts and
        whether every block holds the same parameters."""
        if self._base is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"), no_init():
                self._base = AutoModelForCausalLM.from_config(self.hf_config)
        return self._base

    def unit_fractions(self) -> tuple[float, float]:
        """The largest decoder block's and the output head's shares of the model's parameters (FSDP2 gathers a block
        at a time and the rest, embeddings and head, as one root unit: planner/sharding.py)."""
        model = self.base_model()
        total = max(1, sum(p.numel() for p in model.parameters()))
        blocks = find_blocks(model, self.block_class)
        block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
        head = model.get_output_embeddings()
        return block / total, (sum(p.numel() for p in head.parameters()) if head is not None else 0) / total

    def uniform_blocks(self) -> bool:
        """Whether every decoder block holds the same parameters (names, shapes, dtypes) and buffers."""
        def signature(block: torch.nn.Module) -> tuple:
            return (type(block).__name__,
                    tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_parameters()),
                    tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()))

        # Layer types outside the first three change what sits outside the blocks (Gemma 3's global-attention
        # rotary tables appear at its sixth layer): those models are traced at full depth.
        types = getattr(self.hf_config, "layer_types", None)
        if isinstance(types, list) and len(set(types)) > 1:
            return False
        blocks = find_blocks(self.base_model(), self.block_class)
        return len(blocks) == self.n_blocks and len({signature(b) for b in blocks}) == 1

    def _trace_static(self, stack: Stack) -> StaticTrace:
        # Weights, gradients and optimizer state grow by the same bytes per block when the blocks are alike
        # (Qwen3-30B-A3B's 48): traced at depths 1, 2 and 3, extrapolated when the growth is exactly linear
        # there. Seconds instead of a full-depth build and optimizer step (19 s per stack on that shape).
        # Unlike blocks (DeepSeek's first dense layers, Qwen3-MoE's mlp_only_layers) are traced at full depth, and
        # so are models of up to 6 blocks (the shallow traces would hold as many).
        if self.n_blocks > 6 and self.uniform_blocks():
            shallow = [self._trace_static_at(d, stack) for d in (1, 2, 3)]
            full = extrapolate_static(shallow, self.n_blocks)
            if full is not None:
                return full
        return self._trace_static_at(self.n_blocks, stack)

    def _trace_static_at(self, depth: int, stack: Stack) -> StaticTrace:
        with fake_tracing() as mode:
            model = self._build(depth, stack, mode)
            with mode:
                optimizer = self._optimizer(model, stack)
                if not stack.optimizer_in_backward:  # stepped in backward, the gradients never coexist
                    for g in optimizer.param_groups:
                        for p in g["params"]:
                            p.grad = torch.zeros_like(p)
                tracker = StepTracker(op_seconds=op_cost_model(self.profile))
                tracker.track_external(model, optimizer)
                before = tracker.vec()
                with tracker:
                    run_step(model, optimizer, [], stack.precision, tracker, self.max_grad_norm,
                             in_backward=stack.optimizer_in_backward)
                after = tracker.vec()
        opt_seg = next(s for s in tracker.segments if s.label == "opt")
        # The tracker books everything the optimizer allocates as optimizer state; what is gone after the
        # step (foreach scratch copies) is a temporary.
        opt_peak = dict(opt_seg.peak)
        scratch = max(0, opt_peak["optimizer"] - after["optimizer"])
        opt_peak["optimizer"] -= scratch
        opt_peak["other"] += scratch
        from memfit.models.quantization import logical_param_count

        params = list(model.parameters())
        seconds = opt_seg.seconds
        if not stack.optimizer_in_backward:
            seconds += emulated_step_seconds(stack.optimizer, [(p.numel(), p.element_size()) for p in params
                                                               if p.requires_grad], self.profile)
        return StaticTrace(n_blocks=depth, before_opt=before, after_opt=after, opt_peak=opt_peak,
                           opt_seconds=seconds, n_params=logical_param_count(model),
                           n_trainable=sum(p.numel() for p in params if p.requires_grad),
                           weight_bytes=sum(p.numel() * p.element_size() for p in params),
                           host_bytes=optimizer_host_bytes(optimizer))

    def _optimizer(self, model: torch.nn.Module, stack: Stack) -> Any:
        """The stack's AdamW on fake tensors, its state allocated (inside the fake mode)."""
        # CUDA runs AdamW's multi-tensor (foreach) path by default, with its scratch copies; CPU loops.
        optimizer = make_optimizer(model, self.weight_decay, foreach=self.profile.kind == "cuda",
                                   kind=stack.optimizer, fake=True)
        init_optimizer_state(optimizer)
        return optimizer

    def resolved(self, stack: Stack) -> Stack:
        """The stack with `auto` techniques as a run on this model and device resolves them."""
        from memfit.memory.techniques.loss import resolve_loss
        from memfit.memory.techniques.optim import resolve_optimizer

        vocab = int(getattr(self.hf_config, "vocab_size", 0) or 0)
        # DPO forms its log-probs from the logits (training/objective.py): the plain loss's trace is their twin.
        # Several ranks run the model's own loss (distributed/planning.py): auto is plain there.
        loss = "plain" if self.dpo is not None else resolve_loss(stack.loss, vocab, self.world_size,
                                                                 device_type=self.profile.kind)
        return replace(stack, loss=loss,
                       optimizer=resolve_optimizer(stack.optimizer, self.profile.kind))

    def kind_trace(self, stack: Stack, kind: str) -> KindTrace:
        if kind not in BLOCK_KINDS:
            raise ValueError(kind)
        n_micro = min(stack.grad_accum_steps, 2)
        b, hi = stack.micro_batch_size, self.anchor_micro_batch
        if hi is None or b == 1 or b >= hi:
            return self._traced(stack, kind, b, n_micro)
        lo_t = self._traced(stack, kind, 1, n_micro)
        hi_t = self._traced(stack, kind, hi, n_micro)
        return interpolate(lo_t, hi_t, (b - 1) / (hi - 1))

    def _traced(self, stack: Stack, kind: str, micro_batch: int, n_micro: int) -> KindTrace:
        # The optimizer runs inside backward only when it steps there.
        key = (stack.precision, stack.lora, stack.quantize, kind, micro_batch, n_micro, stack.loss, stack.lean_layers,
               stack.optimizer_in_backward, stack.optimizer if stack.optimizer_in_backward else None)
        if key not in self._traces:
            t0 = time.perf_counter()
            self._traces[key] = self._trace_kind(replace(stack, micro_batch_size=micro_batch,
                                                         grad_accum_steps=n_micro), kind)
            self.trace_seconds += time.perf_counter() - t0
        return self._traces[key]

    def _trace_kind(self, stack: Stack, kind: str) -> KindTrace:
        n_proxy = min(self.n_blocks, PROXY_BLOCKS)
        with fake_tracing() as mode:
            model = self._build(n_proxy, stack, mode)
            blocks = find_blocks(model, self.block_class)
            if len(blocks) != n_proxy:
                raise ConfigError(f"memory.block_class: found {len(blocks)} blocks in a {n_proxy}-layer model; "
                                  "name the class of one decoder layer")
            tracker = StepTracker(blocks, op_seconds=op_cost_model(self.profile),
                                  host_seconds=host_copy_seconds(self.profile))
            assign_blocks(model, [kind] * n_proxy, block_class=self.block_class, save_ops=self.save_ops)
            tracker.track_external(model)
            with mode:
                optimizer = self._optimizer(model, stack) if stack.optimizer_in_backward else None
                tracker.track_external(optimizer)
                batches = self._batches(stack, min(stack.grad_accum_steps, 2))
                try:
                    _run_traced(model, optimizer, batches, stack.precision, tracker, loss_fn=self._loss(stack, tracker),
                                in_backward=stack.optimizer_in_backward)
                except Exception as err:  # the model's own forward failing: one line, not the trace's traceback
                    known = forward_error(err, self.hf_config)
                    if known is None:
                        raise
                    raise known from None
        micro: list[dict[str, Segment]] = [{} for _ in batches]
        for seg in tracker.segments:
            prefix, _, label = seg.label.partition(".")
            if prefix.startswith("m") and label:
                micro[int(prefix[1:])][label] = seg
        # Host memory the blocks' offloaded activations take (not the proxy's own offloaded optimizer state).
        parked = tracker.host_peak_bytes - (optimizer_host_bytes(optimizer) if optimizer is not None else 0)
        return KindTrace(kind=kind, n_proxy=n_proxy, micro=micro, host_bytes_per_block=max(0, parked) // n_proxy)

    def _batches(self, stack: Stack, count: int) -> list[torch.Tensor]:
        vocab = max(int(getattr(self.hf_config, "vocab_size", 0) or 0), 2)
        rows = stack.micro_batch_size * self.rows_per_example
        shape = (1, rows * self.seq_len) if self.flattened else (rows, self.seq_len)
        return [torch.randint(0, vocab, shape) for _ in range(count)]

    # -- estimates ---------------------------------------------------------------------------------------
    def _loss(self, stack: Stack, tracker: StepTracker) -> Any:
        from memfit.memory.estimator.preference import DpoLogps
        from memfit.memory.techniques.loss import loss_by_name

        if self.dpo is not None:  # the policy's log-probs as the objective forms them, not a next-token loss
            # adapter_off and copy: the reference's no-grad forward runs in the step, traced in its place.
            loss = DpoLogps(self.dpo_logits_keep, self._reference(stack), tracker)
        else:  # fused: Liger's twin on fake tensors
            loss = loss_by_name(stack.loss, self.loss_chunk_tokens, emulate=True)
        return MaskedLoss(loss) if self.attention_mask else loss

    def estimate(self, stack: Stack, kinds: Sequence[str]) -> Estimate:
        stack = self.resolved(stack)
        # One rank holds micro-batch / world_size rows of each micro-batch (several ranks split it evenly).
        traced = replace(stack, micro_batch_size=max(1, stack.micro_batch_size // self.world_size))
        traces = {k: self.kind_trace(traced, k) for k in set(kinds)}
        method = (f"fake-tensor trace of a {min(self.n_blocks, PROXY_BLOCKS)}-block proxy per block kind, "
                  f"composed to {self.n_blocks} blocks; optimizer step traced at full depth")
        estimate = compose(self.static(stack), traces, list(kinds), traced, method, keep_moments=self.share is not None)
        if self.dpo is not None:
            from memfit.memory.estimator.preference import with_reference

            estimate = with_reference(estimate, self._reference(stack))
        if self.share is None:
            return replace(estimate, stack=stack)
        return replace(self.share(estimate), stack=stack)

    def _reference(self, stack: Stack) -> str:
        """dpo.reference as the run resolves it for this stack (auto: from the passes over the pairs, where read)."""
        from memfit.memory.estimator.preference import reference_mode

        assert self.dpo is not None
        return reference_mode(self.dpo.reference, self.dpo.loss_type, stack.lora, self.dpo_coverage, self.dpo_sharded)


class MaskedLoss:
    """A loss policy traced with the explicit 4-D boolean mask the run's batches carry ([rows, 1, seq, seq], causal:
    its bytes do not depend on which positions it allows). SDPA converts a boolean mask to the compute dtype in
    every layer and autograd keeps that copy for backward: layers x rows x seq^2 x 4 bytes in fp32, which a trace
    with is_causal alone does not see (tests/integration/test_mask_estimate.py measures it)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        rows, n = ids.shape
        mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril().expand(rows, 1, n, n).contiguous()
        return self.inner(model, {**batch, "attention_mask": mask})


def interpolate(lo: KindTrace, hi: KindTrace, t: float) -> KindTrace:
    """The trace at a micro-batch a fraction t of the way from lo's to hi's (same kind, same micro count)."""
    def mix(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: int(round(a[k] + t * (b[k] - a[k]))) for k in a}

    micro = []
    for lo_m, hi_m in zip(lo.micro, hi.micro, strict=True):
        segs = {}
        for label in lo_m.keys() & hi_m.keys():
            a, b = lo_m[label], hi_m[label]
            segs[label] = Segment(label, mix(a.start, b.start), mix(a.end, b.end), mix(a.peak, b.peak),
                                  a.seconds + t * (b.seconds - a.seconds), b.ops)
        micro.append(segs)
    host = int(round(lo.host_bytes_per_block + t * (hi.host_bytes_per_block - lo.host_bytes_per_block)))
    return KindTrace(kind=lo.kind, n_proxy=lo.n_proxy, micro=micro, host_bytes_per_block=host)


def _run_traced(model: torch.nn.Module, optimizer: Any, batches: list[torch.Tensor], precision: str,
                tracker: StepTracker, max_grad_norm: float | None = 1.0, **step: Any) -> None:
    token = OFFLOAD_EMULATION.set(tracker.offload_hooks())
    try:
        with tracker:
            run_step(model, optimizer, batches, precision, tracker, max_grad_norm, **step)
    finally:
        OFFLOAD_EMULATION.reset(token)


def trace_whole_step(hf_config: Any, stack: Stack, kinds: Sequence[str], seq_len: int, profile: DeviceProfile,
                     *, lora_cfg: Any | None = None, save_ops: Sequence[str] = (), block_class: str | None = None,
                     max_grad_norm: float | None = 1.0) -> dict[str, Any]:
    """The whole-depth step traced in one go (no composition): slower, used to check the composition."""
    with fake_tracing() as mode:
        model = fake_model(hf_config, stack.precision, lora_cfg if stack.lora else None, mode,
                           stack.quantize if stack.lora else "none", stack.lean_layers)
        blocks = find_blocks(model, block_class)
        token = OFFLOAD_EMULATION.set(("offload" in kinds) and (lambda t: t, lambda t: t) or None)
        try:
            assign_blocks(model, list(kinds), block_class=block_class, save_ops=save_ops)
        finally:
            OFFLOAD_EMULATION.reset(token)
        tracker = StepTracker(blocks)
        with mode:
            optimizer = make_optimizer(model, foreach=profile.kind == "cuda")
            init_optimizer_state(optimizer)
            vocab = max(int(getattr(hf_config, "vocab_size", 0) or 0), 2)
            batches = [torch.randint(0, vocab, (stack.micro_batch_size, seq_len))
                       for _ in range(stack.grad_accum_steps)]
            tracker.track_external(model, optimizer)
            _run_traced(model, optimizer, batches, stack.precision, tracker, max_grad_norm)
    res = tracker.result()
    act = max((s.end["activations"] for s in res.segments if s.label.endswith(".fpost")), default=0)
    return {"peak_bytes": res.peak_bytes, "breakdown": res.peak, "activation_bytes": act, "peak_at": res.peak_label}
