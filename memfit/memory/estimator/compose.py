"""Pure memory math: a deep model's training step composed from traced segments of a shallow proxy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.memory.estimator.tracker import BREAKDOWN_KEYS, Segment, Vec, add, total

PROXY_BLOCKS = 3  # first, one interior, last: enough for any depth, since interior blocks are alike


@dataclass(frozen=True)
class Stack:
    """The knobs of one candidate besides checkpointing: what one step computes and in which precision."""

    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    lora: bool
    # The memory techniques besides checkpointing (issue #14); the defaults are today's behaviour.
    quantize: str = "none"  # lora.quantize: none | nf4 (the frozen base in 4 bits)
    loss: str = "plain"  # memory.loss: plain | chunked
    optimizer: str = "adamw"  # memory.optimizer: adamw | adamw-fused | adamw-8bit | adamw-cpu-offload
    optimizer_in_backward: bool = False
    lean_layers: bool = False  # memory.lean_layers: SwiGLU MLPs and RMSNorms saving less (techniques/lean_layers)

    def label(self) -> str:
        extras = [x for x in (self.quantize.upper() if self.quantize != "none" else "",
                              f"{self.loss} loss" if self.loss in ("chunked", "fused") else "",
                              self.optimizer if self.optimizer != "adamw" else "",
                              "step in backward" if self.optimizer_in_backward else "",
                              "lean layers" if self.lean_layers else "") if x]
        return (f"{self.precision}, micro-batch {self.micro_batch_size}x{self.grad_accum_steps}"
                + ((", QLoRA" if self.quantize != "none" else ", LoRA") if self.lora else "")
                + "".join(f", {x}" for x in extras if x != self.quantize.upper()))


@dataclass
class KindTrace:
    """A proxy of `n_proxy` blocks, all checkpointed as `kind`: its segments per micro-batch (0, 1 if accumulating)."""

    kind: str
    n_proxy: int
    micro: list[dict[str, Segment]]
    host_bytes_per_block: int = 0


@dataclass
class StaticTrace:
    """The full-depth model's weights, gradients and optimizer state, and its optimizer step."""

    n_blocks: int
    before_opt: Vec  # params + grads + optimizer state (+ whatever the step leaves alive)
    after_opt: Vec  # params + optimizer state: what a forward starts from
    opt_peak: Vec
    opt_seconds: float
    n_params: int
    n_trainable: int
    weight_bytes: int
    host_bytes: int = 0  # optimizer state kept in host memory (CPU-offloaded AdamW)


def extrapolate_static(shallow: list[StaticTrace], n_blocks: int) -> StaticTrace | None:
    """The full-depth static trace from traces at depths 1, 2, 3 of a model whose blocks are alike: each byte
    count grows by the same amount per block. None when the growth from 1 to 2 and from 2 to 3 differ by a
    single byte (something is not per block: trace at full depth)."""
    a, b, c = shallow

    def line(x: int, y: int, z: int) -> int | None:
        return None if z - y != y - x else z + (n_blocks - 3) * (z - y)

    vecs = []
    for get in (lambda s: s.before_opt, lambda s: s.after_opt, lambda s: s.opt_peak):
        va, vb, vc = get(a), get(b), get(c)
        vec = {k: line(va[k], vb[k], vc[k]) for k in vc}
        if va.keys() != vc.keys() or vb.keys() != vc.keys() or None in vec.values():
            return None
        vecs.append(vec)
    counts = [line(getattr(a, f), getattr(b, f), getattr(c, f))
              for f in ("n_params", "n_trainable", "weight_bytes", "host_bytes")]
    if None in counts:
        return None
    n_params, n_trainable, weight_bytes, host_bytes = counts
    seconds = c.opt_seconds + (n_blocks - 3) * max(0.0, c.opt_seconds - b.opt_seconds)
    return StaticTrace(n_blocks=n_blocks, before_opt=vecs[0], after_opt=vecs[1], opt_peak=vecs[2],
                       opt_seconds=seconds, n_params=n_params, n_trainable=n_trainable, weight_bytes=weight_bytes,
                       host_bytes=host_bytes)


@dataclass
class Estimate:
    """Predicted peak of one steady-state training step (optimizer state allocated), and its time."""

    stack: Stack
    kinds: tuple[str, ...]
    policy: str
    every_k: int | None
    peak_bytes: int
    breakdown: Vec
    activation_bytes: int  # activations alive at the end of the (last) forward
    peak_at: str
    step_seconds: float
    host_bytes: int
    weight_bytes: int
    n_params: int
    n_trainable: int
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Every moment's bytes by category (compose's keep_moments), each with its phase (forward, backward, step): where
    # a step divided over ranks peaks need not be where one process does (sharding shrinks the state, not the
    # activations), and what `other` holds differs by phase (planner/sharding.py rank_parts). Not in the report.
    moments: list[tuple[str, Vec]] = field(default_factory=list, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("moments")
        d["stack"] = asdict(self.stack)
        d["kinds"] = list(self.kinds)
        return d


def policy_name(kinds: tuple[str, ...] | list[str]) -> tuple[str, int | None]:
    """The named policy a block assignment is, if any: none, full, selective, offload, every_k, else mixed."""
    distinct = set(kinds)
    if len(distinct) == 1:
        return next(iter(distinct)), None
    n = len(kinds)
    if distinct == {"full", "none"}:
        for k in range(2, n + 1):
            if all((kind == "full") == (i % k == 0) for i, kind in enumerate(kinds)):
                return "every_k", k
    return "mixed", None


def proxy_index(i: int, n: int, n_proxy: int) -> int:
    """Which proxy block stands for block i of n: the first, the last, or an interior one."""
    if n <= n_proxy:
        return i
    if i == 0:
        return 0
    if i == n - 1:
        return n_proxy - 1
    return min(1, n_proxy - 1)


def _interior_forward_seconds(trace: KindTrace, m: int) -> float:
    """One interior block's forward (its first pass: recompute is backward's) in micro-batch m of a proxy."""
    seg = trace.micro[min(m, len(trace.micro) - 1)].get(f"fb{min(1, trace.n_proxy - 1)}")
    return seg.seconds if seg is not None else 0.0


def _phase(label: str) -> str:
    return "forward" if label.startswith("f") else "backward"


def _where(label: str, block: int | None) -> str:
    phase = _phase(label)
    if block is not None:
        return f"{phase}, block {block}"
    part = {"fpre": "embeddings", "fpost": "head and loss", "fref": "the DPO reference's no-grad forward",
            "bpost": "head and loss", "bpre": "embeddings"}
    return f"{phase}, {part.get(label, label)}"


def compose(static: StaticTrace, traces: dict[str, KindTrace], kinds: list[str] | tuple[str, ...],
            stack: Stack, method: str = "", keep_moments: bool = False) -> Estimate:
    """Walk the step segment by segment for `kinds` (one per block), tracking memory by category; keep_moments:
    every segment's high point too (Estimate.moments)."""
    n = len(kinds)
    if n != static.n_blocks:
        raise ValueError(f"{n} block kinds for a {static.n_blocks}-block model")
    first, last = traces[kinds[0]], traces[kinds[-1]]
    mem = dict(static.after_opt)
    best: tuple[int, Vec, str] = (total(mem), dict(mem), "start of step")
    moments: list[tuple[str, Vec]] = [("forward", dict(mem))] if keep_moments else []
    seconds = 0.0
    activations = 0

    def visit(seg: Segment | None, where: str, phase: str) -> None:
        nonlocal mem, best
        if seg is None:
            return
        candidate = add(mem, seg.rise)
        if keep_moments:
            moments.append((phase, candidate))
        if total(candidate) > best[0]:
            best = (total(candidate), candidate, where)
        mem = add(mem, seg.delta)

    accum = stack.grad_accum_steps
    for m in range(min(accum, 2)):
        micro_seconds = 0.0
        order: list[tuple[KindTrace, str, int | None]] = [(first, "fpre", None)]
        order += [(traces[kinds[i]], f"fb{proxy_index(i, n, traces[kinds[i]].n_proxy)}", i) for i in range(n)]
        order += [(last, "fpost", None), (last, "fref", None), (last, "bpost", None)]
        order += [(traces[kinds[i]], f"bb{proxy_index(i, n, traces[kinds[i]].n_proxy)}", i)
                  for i in reversed(range(n))]
        order += [(first, "bpre", None)]
        for trace, label, block in order:
            seg = trace.micro[min(m, len(trace.micro) - 1)].get(label)
            visit(seg, f"micro-batch {m + 1}, {_where(label, block)}", _phase(label))
            micro_seconds += seg.seconds if seg is not None else 0.0
            if label == "fref" and seg is not None:  # the proxy's no-grad forward: the other blocks' forwards too
                micro_seconds += (n - last.n_proxy) * _interior_forward_seconds(last, m)
            if label == "fpost":
                activations = mem["activations"]
        # Micro-batches after the second start from the same state as the second: same memory, same time.
        seconds += micro_seconds * (1 if m == 0 else accum - 1)
    # The optimizer step, measured on the full-depth model; shifted by whatever else is alive here.
    leftover = add(mem, static.before_opt, -1)
    opt = add(static.opt_peak, leftover)
    if keep_moments:
        moments.append(("step", opt))
    if total(opt) > best[0]:
        best = (total(opt), opt, "optimizer step")
    seconds += static.opt_seconds
    name, k = policy_name(tuple(kinds))
    host = sum(traces[kind].host_bytes_per_block for kind in kinds) + static.host_bytes
    breakdown = {key: max(0, best[1][key]) for key in BREAKDOWN_KEYS}
    return Estimate(stack=stack, kinds=tuple(kinds), policy=name, every_k=k, peak_bytes=sum(breakdown.values()),
                    breakdown=breakdown, activation_bytes=max(0, activations), peak_at=best[2],
                    step_seconds=seconds, host_bytes=host, weight_bytes=static.weight_bytes,
                    n_params=static.n_params, n_trainable=static.n_trainable, method=method,
                    moments=[(phase, {key: max(0, v[key]) for key in BREAKDOWN_KEYS}) for phase, v in moments])

