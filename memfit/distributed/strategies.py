"""Wrapping a model for several ranks: the process group, DDP, FSDP2 (fully_shard per block) and checks."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError

log = logging.getLogger("memfit.distributed")

TORCH_STRATEGIES = ("ddp", "fsdp2")
DEEPSPEED_STRATEGIES = ("deepspeed_zero2", "deepspeed_zero3")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: global rank, world size, its rank on this node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_backend(requested: str, device_type: str) -> str:
    """auto: nccl for CUDA tensors, gloo for CPU ones; nccl without CUDA is a config error."""
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA devices; use auto or gloo on CPU")
    return requested


def check_strategy(strategy: str, precision: str) -> None:
    """Combinations memfit refuses up front, with the alternative."""
    if strategy == "fsdp2" and precision == "fp16-mixed":
        # Sharded gradients would need a rank-agreed inf check; bf16 needs no loss scaling at all.
        raise ConfigError("train.precision=fp16-mixed is not supported with distributed.strategy=fsdp2; use "
                          "bf16-mixed, or ddp / deepspeed_zero2 / deepspeed_zero3 for fp16")


def init_process_group(requested_backend: str, device_request: str, timeout_minutes: float) -> RankInfo:
    """Join the job torchrun started (its env:// variables) and pick this rank's device."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_request in ("auto", "cuda") and torch.cuda.is_available()
    if device_request == "cuda" and not use_cuda:
        raise ConfigError("train.device: 'cuda' requested but no CUDA device is visible; use auto or cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"distributed.nproc_per_node: local rank {local_rank} has no GPU "
                              f"({torch.cuda.device_count()} visible); lower nproc_per_node")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = resolve_backend(requested_backend, device.type)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=timeout_minutes)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return RankInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def check_same_weights(model: nn.Module, info: RankInfo) -> None:
    """Every rank must start from the same weights (FSDP2 keeps each rank's own shard of its own copy):
    compare a cheap fingerprint across ranks instead of broadcasting the whole model."""
    import torch.distributed as dist

    with torch.no_grad():
        fp = torch.zeros(2, dtype=torch.float64)
        for p in model.parameters():
            fp[0] += p.detach().double().sum().cpu()
            fp[1] += p.detach().double().abs().sum().cpu()
    # NCCL gathers device tensors only: the inputs and every output on this rank's GPU.
    dev = info.device if info.backend == "nccl" else torch.device("cpu")
    gathered = [torch.zeros_like(fp, device=dev) for _ in range(info.world_size)]
    dist.all_gather(gathered, fp.to(dev))
    ref = gathered[0].cpu()
    bad = [r for r, g in enumerate(gathered) if not torch.allclose(g.cpu(), ref, rtol=1e-9, atol=0.0)]
    if bad:
        from memfit.errors import DistributedError

        raise DistributedError(f"ranks {bad} loaded different initial weights than rank 0; every node must load "
                               "the same model.name_or_path (same files, same preset settings)")


def wrap_ddp(model: nn.Module, info: RankInfo) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    model.to(info.device)
    # Gradients as views into the all-reduce buckets: no second copy of the gradients (see planner/sharding.py).
    return DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def wrap_fsdp2(model: nn.Module, info: RankInfo, precision: str) -> nn.Module:
    """fully_shard each decoder block, then the root (embeddings, final norm, head).

    The gradient-checkpointing policy must already be applied (memfit/memory/techniques/policies.py apply_policy):
    transformers checkpoints each block's forward, inside FSDP2's hooks, so a recompute does not all-gather
    twice. Mixed bf16 runs compute in bf16 with fp32 gradient reduction and fp32 sharded master weights.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from memfit.models.loading import find_decoder_blocks

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if precision == "bf16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(info.device)
    blocks = find_decoder_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed first in backward: keep them gathered after forward.
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module a wrapper trains: DDP's inner module (no gradient hooks), the one a DeepSpeed engine holds (the
    engine's optimizer and buffers are never copied); FSDP2 and peft modules stay as they are."""
    return getattr(model, "module", model)


def sharded_parameters(model: nn.Module) -> bool:
    """Whether the model's parameters are split over the ranks (FSDP2's DTensors, ZeRO-3's partitions): such a model
    is not copied (each rank holds a slice), and reading its weights whole is a collective."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "ds_tensor") for p in model.parameters())


def grad_norm_value(norm: Any) -> float:
    """clip_grad_norm_ returns a DTensor under FSDP2: its full value is the global norm."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
