"""Reading a verified local training checkpoint folder (single-file, sharded or DeepSpeed) without unpickling."""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from memfit.checkpoints.format import (
    CONFIG_FILE,
    DEEPSPEED_FORMAT,
    METADATA_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SHARDED_FORMAT,
    STATE_FILE,
    CheckpointInfo,
    LoadedCheckpoint,
    is_sharded_folder,
    rng_file,
    rng_tensors_of,
)
from memfit.errors import CheckpointError


def read_checkpoint_folder(folder: Path, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
    """Read a verified local checkpoint folder. Nothing is unpickled: weights_only loads and JSON."""
    if is_sharded_folder(folder):
        return read_sharded_folder(folder, info)
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        model_state = load_file(str(folder / MODEL_FILE))
        optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(folder / RNG_FILE, map_location="cpu", weights_only=True)
        config_yaml = (folder / CONFIG_FILE).read_text()
    except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as err:
        # weights_only refuses arbitrary pickles with UnpicklingError: a planted object never runs.
        raise CheckpointError(f"{folder}: unreadable training checkpoint ({err})") from None
    if info is None:
        info = CheckpointInfo(step=int(state["step"]), prefix=folder.name, uri=str(folder))
    return LoadedCheckpoint(info=info, model_state=model_state, optimizer_state=optimizer_state,
                            rng_tensors=rng, state=state, config_yaml=config_yaml)


# -- DCP's index, through an allow-list -------------------------------------------------------------------
_ALLOWED_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's index is a pickle; only its own plain data classes (and torch dtypes) may be rebuilt from it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{METADATA_FILE}: refuses to load {module}.{name} (not part of a DCP index)")


def read_metadata(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated or foreign files raise many types
        raise CheckpointError(f"{path}: unreadable sharded-checkpoint index ({err})") from None


def dcp_reader(folder: Path) -> Any:
    """A DCP FileSystemReader whose index goes through the allow-list above."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path) / METADATA_FILE)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _no_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    # memfit stores only tensors in DCP (everything else is JSON): a bytes item means a foreign file.
    raise CheckpointError(f"sharded training checkpoint holds a non-tensor item {read_item.dest_index.fqn!r}; "
                          "memfit never writes one, refusing to unpickle it")


def tensor_only_planners() -> tuple[type, type]:
    """DCP load planners (into a state dict, into an empty one) that refuse pickled non-tensor items."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    load = type("TensorOnlyLoadPlanner", (DefaultLoadPlanner,), {"load_bytes": _no_bytes})
    empty = type("TensorOnlyEmptyPlanner", (_EmptyStateDictLoadPlanner,), {"load_bytes": _no_bytes})
    return load, empty


def consolidate(folder: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Whole (unsharded) tensors of a local sharded checkpoint, in this process, no process group needed."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _, empty = tensor_only_planners()
    out: dict[str, Any] = {}
    try:
        _load_state_dict(out, storage_reader=dcp_reader(folder), planner=empty(keys=keys), no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{folder}: cannot read the sharded training checkpoint ({err})") from None
    return out


class _Lazy(Mapping):
    """A state dict read on first use: phase 4 only needs state.json, not gigabytes of tensors."""

    def __init__(self, load: Callable[[], dict[str, Any]]) -> None:
        self._load, self._data = load, None

    def _get(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._load()
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def copy(self) -> dict[str, Any]:  # Optimizer.load_state_dict starts with a shallow copy
        return dict(self._get())


def indexed_optimizer_state(fqn_state: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """FQN-keyed optimizer state (DCP) -> torch's positional form, in the saved param-group order."""
    state, groups, i = {}, [], 0
    for group in param_groups:
        ids = []
        for fqn in group["params"]:
            if fqn in fqn_state:
                state[i] = fqn_state[fqn]
            ids.append(i)
            i += 1
        g = {**group, "params": ids}
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def read_sharded_folder(folder: Path, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
    """A verified local sharded checkpoint as a LoadedCheckpoint; tensors are consolidated only when used."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        config_yaml = (folder / CONFIG_FILE).read_text()
        rank0 = json.loads((folder / rng_file(0)).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: unreadable sharded training checkpoint ({err})") from None
    if info is None:
        info = CheckpointInfo(step=int(state["step"]), prefix=folder.name, uri=str(folder))
    if state.get("checkpoint_format") == DEEPSPEED_FORMAT:
        return _read_deepspeed_folder(folder, info, state, config_yaml, rank0)
    if state.get("checkpoint_format") != SHARDED_FORMAT:
        raise CheckpointError(f"{folder}: not a {SHARDED_FORMAT} checkpoint")
    read_metadata(folder / METADATA_FILE)  # a broken or hostile index fails here, at verification
    groups = state["optim_param_groups"]
    model = _Lazy(lambda: consolidate(folder, {"model"}).get("model", {}))
    optim = _Lazy(lambda: indexed_optimizer_state(consolidate(folder, {"optim"}).get("optim", {}), groups))
    return LoadedCheckpoint(info=info, model_state=model, optimizer_state=optim,
                            rng_tensors=rng_tensors_of(rank0), state=state, config_yaml=config_yaml)


def _read_deepspeed_folder(folder: Path, info: CheckpointInfo, state: dict[str, Any], config_yaml: str,
                           rank0: dict[str, Any]) -> LoadedCheckpoint:
    """Export reads the whole weights rank 0 wrote; the ZeRO optimizer partitions only load under DeepSpeed."""

    def refuse() -> dict[str, Any]:
        raise CheckpointError(f"{info.uri}: a DeepSpeed training checkpoint resumes only under DeepSpeed on "
                              f"{state.get('world_size')} ranks (distributed.strategy={state.get('strategy')})")

    model = _Lazy(lambda: load_file(str(folder / MODEL_FILE)))
    return LoadedCheckpoint(info=info, model_state=model, optimizer_state=_Lazy(refuse),
                            rng_tensors=rng_tensors_of(rank0), state=state, config_yaml=config_yaml)
