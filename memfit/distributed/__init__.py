"""Scale-out: torchrun launch, the process group, DDP / FSDP2 wrapping, DeepSpeed config, per-rank planning."""

from __future__ import annotations

from typing import Any


def world_size(cfg: Any) -> int:
    """Processes taking part in training (nproc_per_node x nnodes); 1 is the single-process path."""
    return cfg.distributed.nproc_per_node * cfg.distributed.nnodes


def is_distributed(cfg: Any) -> bool:
    return world_size(cfg) > 1
