"""What a training checkpoint is: file names and formats, the manifest's records, snapshots, RNG payloads."""

# Layout in the store: `step-NNNNNNNN/` folders, each committed by its `manifest.json`, written last.
# One process writes model.safetensors, optimizer.pt, rng.pt, state.json, config.yaml. Several ranks write
# through torch.distributed.checkpoint (sharded.py): `__<rank>_<n>.distcp`, `dcp-metadata` (DCP's index),
# state.json + config.yaml (rank 0) and `rng-rank<NNNNN>.json` (each rank); DeepSpeed ZeRO its own files
# plus `deepspeed-config.json` and whole 16-bit weights. Nothing but JSON and tensors is ever read back.

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT = "memfit-training-checkpoint/1"
SHARDED_FORMAT = "memfit-sharded-training-checkpoint/1"
DEEPSPEED_FORMAT = "memfit-deepspeed-training-checkpoint/1"
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
DEEPSPEED_CONFIG_FILE = "deepspeed-config.json"
METADATA_FILE = "dcp-metadata"  # DCP's ".metadata", renamed: dot-names are not allowed in a manifest
STEP_DIR = re.compile(r"^step-(\d{8})/")


def step_prefix(step: int) -> str:
    return f"step-{step:08d}"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.json"


def part_key(prefix: str, rank: int) -> str:
    return f"{prefix}/part-rank{rank:05d}.json"


def is_deepspeed_folder(folder: Path) -> bool:
    return (folder / DEEPSPEED_CONFIG_FILE).is_file()


def is_sharded_folder(folder: Path) -> bool:
    """Written by several ranks (DCP or DeepSpeed), as opposed to a single-process training checkpoint."""
    return (folder / METADATA_FILE).is_file() or is_deepspeed_folder(folder)


@dataclass
class CheckpointInfo:
    step: int
    prefix: str
    uri: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_at: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


@dataclass
class CheckpointEntry:
    """A step folder found in the store; only status "complete" (a valid manifest) can ever be loaded."""

    step: int
    prefix: str
    uri: str
    objects: int
    status: str
    info: CheckpointInfo | None = None


@dataclass
class CheckpointContents:
    """What a training checkpoint holds: weights, optimizer state, RNG states, the loop's state, the config."""

    model_state: Mapping[str, torch.Tensor]
    optimizer_state: Mapping[str, Any]
    rng_tensors: dict[str, Any]
    state: dict[str, Any]
    config_yaml: str


@dataclass
class LoadedCheckpoint(CheckpointContents):
    """The contents read back from the store, with the record of where they came from."""

    info: CheckpointInfo

    @property
    def step(self) -> int:
        return self.info.step


@dataclass
class Snapshot(CheckpointContents):
    """Everything needed to resume, already copied to CPU memory so training can go on while it is written."""

    step: int


def _cpu_copy(obj: Any) -> Any:
    # Clone, not just move: a CPU tensor would otherwise alias the live parameter being updated.
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def take_snapshot(step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                  rng_tensors: dict[str, Any], state: dict[str, Any], config_yaml: str) -> Snapshot:
    return Snapshot(step=step, model_state=_cpu_copy(model_state), optimizer_state=_cpu_copy(optimizer_state),
                    rng_tensors=_cpu_copy(rng_tensors), state=json.loads(json.dumps(state)),
                    config_yaml=config_yaml)


# -- RNG state as JSON (each rank of a sharded checkpoint writes its own) ---------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _bytes_tensor(b64: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8).clone()


def rng_payload(rng_json: dict[str, Any], rng_tensors: dict[str, Any]) -> dict[str, Any]:
    out = {"rng": rng_json, "torch": _b64(rng_tensors["torch"])}
    cuda = rng_tensors.get("cuda")
    if isinstance(cuda, torch.Tensor):  # this rank's own device
        out["cuda_device"] = _b64(cuda)
    elif cuda is not None:
        out["cuda"] = [_b64(t) for t in cuda]
    return out


def rng_tensors_of(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": _bytes_tensor(payload["torch"])}
    if payload.get("cuda_device"):
        out["cuda"] = _bytes_tensor(payload["cuda_device"])
    elif payload.get("cuda"):  # written by an earlier memfit: one state per visible GPU
        out["cuda"] = [_bytes_tensor(s) for s in payload["cuda"]]
    return out


def rng_from_payload(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return payload["rng"], rng_tensors_of(payload)
