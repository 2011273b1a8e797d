"""Sharded training checkpoints (torch.distributed.checkpoint): each rank writes its shard, rank 0 commits."""

# Layout in the store, beside the single-process ones (`step-NNNNNNNN/`, committed by `manifest.json`):
# `__<rank>_<n>.distcp` (each rank's tensors), `dcp-metadata` (DCP's index, written by rank 0),
# `state.json` + `config.yaml` (rank 0: step, schedule, data order, optimizer hyper-parameters),
# `rng-rank<NNNNN>.json` (each rank's RNG). A save: every rank writes DCP to a local staging folder, uploads
# its own files in the background and then a small `part-rank<NNNNN>.json` marker; rank 0 waits for every
# marker of this save and writes the manifest last. Loads reshard to any world size, including a single
# process (which consolidates offline). Nothing is unpickled but DCP's index, through an allow-list.

from __future__ import annotations

import base64
import contextvars
import glob
import io
import json
import logging
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from memfit.checkpointing import (
    CONFIG_FILE,
    MANIFEST,
    SHARDED_FORMAT,
    STATE_FILE,
    CheckpointInfo,
    CheckpointManager,
    LoadedCheckpoint,
    sha256_file,
    step_prefix,
)
from memfit.errors import CheckpointError
from memfit.storage.base import ObjectStore

log = logging.getLogger("memfit.dist_checkpoint")

# DeepSpeed ZeRO checkpoints use the same upload / commit protocol with DeepSpeed's own files inside.
DEEPSPEED_FORMAT = "memfit-deepspeed-training-checkpoint/1"
DEEPSPEED_CONFIG_FILE = "deepspeed-config.json"
METADATA_FILE = "dcp-metadata"  # DCP's ".metadata", renamed: dot-names are not allowed in a manifest
_DCP_METADATA = ".metadata"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.json"


def part_key(prefix: str, rank: int) -> str:
    return f"{prefix}/part-rank{rank:05d}.json"


def is_deepspeed_folder(folder: Path) -> bool:
    return (folder / DEEPSPEED_CONFIG_FILE).is_file()


def is_sharded_folder(folder: Path) -> bool:
    """Written by several ranks (DCP or DeepSpeed), as opposed to a single-process training checkpoint."""
    return (folder / METADATA_FILE).is_file() or is_deepspeed_folder(folder)


# -- reading DCP without trusting pickles ------------------------------------------------------------
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


def _reader(folder: Path) -> Any:
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


def _planners() -> tuple[type, type]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    load = type("TensorOnlyLoadPlanner", (DefaultLoadPlanner,), {"load_bytes": _no_bytes})
    empty = type("TensorOnlyEmptyPlanner", (_EmptyStateDictLoadPlanner,), {"load_bytes": _no_bytes})
    return load, empty


def consolidate(folder: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Whole (unsharded) tensors of a local sharded checkpoint, in this process, no process group needed."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _, empty = _planners()
    out: dict[str, Any] = {}
    try:
        _load_state_dict(out, storage_reader=_reader(folder), planner=empty(keys=keys), no_dist=True)
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


def _rng_tensors(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": _bytes_tensor(payload["torch"])}
    if payload.get("cuda_device"):
        out["cuda"] = _bytes_tensor(payload["cuda_device"])
    elif payload.get("cuda"):  # written by an earlier memfit: one state per visible GPU
        out["cuda"] = [_bytes_tensor(s) for s in payload["cuda"]]
    return out


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
    return LoadedCheckpoint(info=info, model_state=model, optimizer_state=optim,  # type: ignore[arg-type]
                            rng_tensors=_rng_tensors(rank0), state=state, config_yaml=config_yaml)


def _read_deepspeed_folder(folder: Path, info: CheckpointInfo, state: dict[str, Any], config_yaml: str,
                           rank0: dict[str, Any]) -> LoadedCheckpoint:
    """Export reads the whole weights rank 0 wrote; the ZeRO optimizer partitions only load under DeepSpeed."""
    from safetensors.torch import load_file

    def refuse() -> dict[str, Any]:
        raise CheckpointError(f"{info.uri}: a DeepSpeed training checkpoint resumes only under DeepSpeed on "
                              f"{state.get('world_size')} ranks (distributed.strategy={state.get('strategy')})")

    model = _Lazy(lambda: load_file(str(folder / "model.safetensors")))
    return LoadedCheckpoint(info=info, model_state=model, optimizer_state=_Lazy(refuse),  # type: ignore[arg-type]
                            rng_tensors=_rng_tensors(rank0), state=state, config_yaml=config_yaml)


def _bytes_tensor(b64: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8).clone()


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def rng_payload(rng_json: dict[str, Any], rng_tensors: dict[str, Any]) -> dict[str, Any]:
    out = {"rng": rng_json, "torch": _b64(rng_tensors["torch"])}
    cuda = rng_tensors.get("cuda")
    if isinstance(cuda, torch.Tensor):  # this rank's own device
        out["cuda_device"] = _b64(cuda)
    elif cuda is not None:
        out["cuda"] = [_b64(t) for t in cuda]
    return out


# -- loading into live (wrapped) models on every rank ----------------------------------------------
def load_into(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load weights and optimizer state (resharded to this world size) and return (state.json, this rank's
    RNG payload or None when the checkpoint had fewer ranks). Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((folder / STATE_FILE).read_text())
    msd, osd = get_state_dict(model, optimizer)
    target = {"model": msd, "optim": osd["state"]}
    load_planner, _ = _planners()
    try:
        dcp.load(target, storage_reader=_reader(folder), planner=load_planner())
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{folder}: the sharded training checkpoint does not fit this model ({err})") from None
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in state["optim_param_groups"]]
    set_state_dict(model, optimizer, model_state_dict=target["model"],
                   optim_state_dict={"state": target["optim"], "param_groups": groups})
    own = folder / rng_file(rank)
    rng = json.loads(own.read_text()) if own.is_file() else None
    return state, rng


def rng_from_payload(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return payload["rng"], _rng_tensors(payload)


# -- saving ------------------------------------------------------------------------------------------
class ShardedCheckpointer:
    """One rank's side of sharded saves; rank 0 also commits (manifest) and applies retention."""

    def __init__(self, store: ObjectStore, staging_dir: Path, rank: int, world_size: int, keep_last: int,
                 commit_timeout_s: float = 1800.0) -> None:
        self.store, self.staging_dir = store, Path(staging_dir)
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.commit_timeout_s = commit_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-dcp-upload")
        self._inflight: Future[None] | None = None
        self.last_step: int | None = None
        self.saves = 0
        self._manager = CheckpointManager(store, keep_last=keep_last) if rank == 0 else None

    def begin(self, step: int) -> tuple[str, str, Path]:
        """Collective: (prefix, save id, this node's empty staging folder) for a save of `step`."""
        import torch.distributed as dist

        self.wait()  # one save in flight per rank; a failed upload is raised here
        prefix = step_prefix(step)
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        save_id = str(box[0])
        if self.rank == 0:
            # A re-save of the same step (a crash between upload and manifest) first drops the old manifest.
            self.store.delete(f"{prefix}/{MANIFEST}")
        local = self.staging_dir / f"{prefix}-{save_id[:12]}"
        local.mkdir(parents=True, exist_ok=True)
        return prefix, save_id, local

    def finish(self, step: int, prefix: str, save_id: str, local: Path, mine: list[Path], rng: dict[str, Any],
               state: dict[str, Any] | None, config_yaml: str, blocking: bool) -> None:
        """Add this rank's RNG (and on rank 0 state.json + config.yaml), then upload and commit in the background."""
        (local / rng_file(self.rank)).write_text(json.dumps(rng))
        mine = [*mine, local / rng_file(self.rank)]
        if self.rank == 0:
            if state is None:
                raise ValueError("rank 0 must pass the JSON resume state")
            payload = {"checkpoint_format": SHARDED_FORMAT, **state, "step": step, "world_size": self.world_size}
            (local / STATE_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True))
            (local / CONFIG_FILE).write_text(config_yaml)
            mine += [local / STATE_FILE, local / CONFIG_FILE]
        self.last_step = step
        self.saves += 1
        ctx = contextvars.copy_context()
        self._inflight = self._pool.submit(ctx.run, self._upload_and_commit, step, prefix, save_id, local, mine)
        if blocking:
            self.wait()

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: dict[str, Any] | None, config_yaml: str, rng: dict[str, Any], blocking: bool) -> None:
        """Collective DCP save. `state`: the JSON resume state (rank 0 only; optimizer groups are added here)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        prefix, save_id, local = self.begin(step)
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd["state"]},
                 storage_writer=dcp.FileSystemWriter(str(local), single_file_per_rank=True, overwrite=True))
        mine = [Path(p) for p in sorted(glob.glob(str(local / f"__{self.rank}_*.distcp")))]
        if self.rank == 0:
            os.replace(local / _DCP_METADATA, local / METADATA_FILE)
            mine.append(local / METADATA_FILE)
            # Optimizer hyper-parameters (lr, betas, ...) and the parameter names of each group, as JSON.
            state = {**(state or {}), "optim_param_groups": osd["param_groups"]}
        self.finish(step, prefix, save_id, local, mine, rng, state, config_yaml, blocking)

    def _upload_and_commit(self, step: int, prefix: str, save_id: str, local: Path, files: list[Path]) -> None:
        t0 = time.perf_counter()
        meta = {}
        for path in files:
            meta[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
            self.store.put_file(path, f"{prefix}/{path.name}")
        for path in files:
            path.unlink(missing_ok=True)
        marker = {"save_id": save_id, "rank": self.rank, "files": meta}
        self.store.put_bytes(part_key(prefix, self.rank), json.dumps(marker).encode())
        if self.rank == 0:
            self._commit(step, prefix, save_id)
            shutil.rmtree(local, ignore_errors=True)
            if local.parent != self.staging_dir:  # DeepSpeed's <save>/<tag>/ layout: the save folder too
                shutil.rmtree(local.parent, ignore_errors=True)
            log.info("sharded training checkpoint step %d committed to %s (%d ranks, %.2f s)", step,
                     f"{self.store.uri.rstrip('/')}/{prefix}", self.world_size, time.perf_counter() - t0)
        else:
            try:
                local.rmdir()
            except OSError:
                pass  # other ranks' files (same node) are still there: they remove their own

    def _commit(self, step: int, prefix: str, save_id: str) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        parts: dict[int, dict[str, Any]] = {}
        while len(parts) < self.world_size:
            for r in range(self.world_size):
                if r in parts:
                    continue
                try:
                    marker = json.loads(self.store.get_bytes(part_key(prefix, r)))
                except Exception as err:  # noqa: BLE001 - not there yet (or half-written: read again)
                    log.debug("rank %d's marker for step %d not there yet (%s)", r, step, err)
                    continue
                if marker.get("save_id") == save_id:  # a stale marker from an interrupted attempt is ignored
                    parts[r] = marker
            if len(parts) < self.world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(parts))
                    raise CheckpointError(f"sharded training checkpoint step {step}: ranks {missing} did not finish "
                                          f"uploading within {self.commit_timeout_s:.0f} s "
                                          "(distributed.timeout_minutes); it stays incomplete")
                time.sleep(0.2)
        files: dict[str, Any] = {}
        for r in sorted(parts):
            files.update(parts[r]["files"])
        manifest = {"format": SHARDED_FORMAT, "step": step, "created_at": time.time(), "files": dict(sorted(
            files.items())), "world_size": self.world_size}
        # The manifest goes last: until it exists, the checkpoint does not.
        self.store.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        for r in parts:
            self.store.delete(part_key(prefix, r))
        assert self._manager is not None
        self._manager._apply_retention()  # the same keep_last / debris rule as single-process saves

    def committed_uri(self) -> str | None:
        """Rank 0: the newest complete training checkpoint in the store (after `wait`); others: None."""
        if self._manager is None:
            return None
        complete = self._manager.list()
        return complete[-1].uri if complete else None

    def raise_if_failed(self) -> None:
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self.wait()

    def wait(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is None:
            return
        try:
            fut.result()
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"rank {self.rank}: uploading a sharded training checkpoint to "
                                  f"{self.store.uri} failed ({err})") from err

    def drain(self, timeout_s: float) -> None:
        """On a failure: give the save in flight a bounded chance to commit (never raises).

        A rank that crashes after step N's snapshot still finishes uploading it, and rank 0 still writes
        its manifest if every rank did, so the rerun resumes from step N rather than the save before it.
        """
        fut = self._inflight
        if fut is None or self.last_step is None:
            return
        try:
            fut.result(timeout=timeout_s)
            log.info("rank %d: training checkpoint step %d finished uploading before exit", self.rank, self.last_step)
        except Exception as err:  # noqa: BLE001 - the run is failing anyway; report, do not mask
            log.warning("rank %d: training checkpoint step %d did not finish before exit: %s", self.rank,
                        self.last_step, err or type(err).__name__)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._manager is not None:
                self._manager.close()
