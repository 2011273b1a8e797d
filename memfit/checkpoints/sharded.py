"""Sharded training checkpoints (torch.distributed.checkpoint): each rank writes its shard, rank 0 commits."""

# A save: every rank writes its files (DCP, or DeepSpeed's) to a local staging folder, uploads them through
# the background writer (retries, on_busy agreed across ranks, deadline) and then a small
# `part-rank<NNNNN>.json` marker; rank 0 waits for every marker of this save and writes the manifest last.
# Loads reshard to any world size, including a single process (reader.py consolidates offline).

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoints.format import (
    CONFIG_FILE,
    MANIFEST,
    METADATA_FILE,
    SHARDED_FORMAT,
    STATE_FILE,
    part_key,
    rng_file,
    step_prefix,
)
from memfit.checkpoints.index import CheckpointIndex
from memfit.checkpoints.reader import dcp_reader, tensor_only_planners
from memfit.checkpoints.writer import BackgroundWriter
from memfit.errors import CheckpointError
from memfit.files import file_record
from memfit.storage.base import ObjectStore

log = logging.getLogger("memfit.checkpoints")
_DCP_METADATA = ".metadata"
# write(local folder) -> (the folder holding this rank's files, those files, state.json additions of rank 0)
ShardWriter = Callable[[Path], tuple[Path, list[Path], dict[str, Any]]]


@dataclass
class _Staged:
    step: int
    prefix: str
    save_id: str
    folder: Path
    files: list[Path]


def dcp_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> ShardWriter:
    """A ShardWriter for DDP / FSDP2 models: DCP of the model and optimizer state, one file per rank."""

    def write(local: Path) -> tuple[Path, list[Path], dict[str, Any]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd["state"]},
                 storage_writer=dcp.FileSystemWriter(str(local), single_file_per_rank=True, overwrite=True))
        mine = [Path(p) for p in sorted(glob.glob(str(local / f"__{rank}_*.distcp")))]
        if rank != 0:
            return local, mine, {}
        os.replace(local / _DCP_METADATA, local / METADATA_FILE)
        # Optimizer hyper-parameters (lr, betas, ...) and the parameter names of each group, as JSON.
        return local, [*mine, local / METADATA_FILE], {"optim_param_groups": osd["param_groups"]}

    return write


class ShardedCheckpointer(BackgroundWriter):
    """One rank's side of sharded saves; rank 0 also commits (manifest) and applies retention."""

    def __init__(self, store: ObjectStore, staging_dir: Path, rank: int, world_size: int, keep_last: int,
                 commit_timeout_s: float = 1800.0, **writer: Any) -> None:
        super().__init__(name="memfit-dcp-upload", **writer)
        self.store, self.staging_dir = store, Path(staging_dir)
        self.rank, self.world_size = rank, world_size
        self.commit_timeout_s = commit_timeout_s
        self.index = CheckpointIndex(store, keep_last)

    def describe(self, step: int) -> str:
        return self.index.uri(step_prefix(step))

    def latest_uri(self) -> str | None:
        """Rank 0: the newest complete training checkpoint in the store (after `wait`); others: None."""
        return self.index.latest_uri() if self.rank == 0 else None

    def save(self, step: int, write: ShardWriter, state: dict[str, Any] | None, config_yaml: str,
             rng: Callable[[], dict[str, Any]], *, blocking: bool, force: bool = False,
             deadline: float | None = None, busy: bool | None = None) -> Future[Any] | None:
        """Collective. `state`: the JSON resume state (rank 0 only); `rng`: this rank's RNG payload, taken
        with the snapshot. Every rank must pass the same `busy` (any rank busy), so that all skip or none."""
        return self.submit(step, lambda: self._snapshot(step, write, state, config_yaml, rng()), blocking=blocking,
                           force=force, deadline=deadline, busy=busy)

    def _snapshot(self, step: int, write: ShardWriter, state: dict[str, Any] | None, config_yaml: str,
                  rng: dict[str, Any]) -> _Staged:
        import torch.distributed as dist

        prefix = step_prefix(step)
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        save_id = str(box[0])
        if self.rank == 0:
            # A re-save of the same step (a crash between upload and manifest) first drops the old manifest.
            self.store.delete(f"{prefix}/{MANIFEST}")
        local = self.staging_dir / f"{prefix}-{save_id[:12]}"
        local.mkdir(parents=True, exist_ok=True)
        folder, mine, extra = write(local)
        (folder / rng_file(self.rank)).write_text(json.dumps(rng))
        mine = [*mine, folder / rng_file(self.rank)]
        if self.rank == 0:
            if state is None:
                raise ValueError("rank 0 must pass the JSON resume state")
            payload = {"checkpoint_format": SHARDED_FORMAT, **state, **extra, "step": step,
                       "world_size": self.world_size}
            (folder / STATE_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True))
            (folder / CONFIG_FILE).write_text(config_yaml)
            mine += [folder / STATE_FILE, folder / CONFIG_FILE]
        return _Staged(step, prefix, save_id, folder, mine)

    def _upload(self, staged: _Staged) -> tuple[None, int]:
        t0 = time.perf_counter()
        meta = {}
        for path in staged.files:
            meta[path.name] = file_record(path)
            self.store.put_file(path, f"{staged.prefix}/{path.name}", consume=True)
        marker = {"save_id": staged.save_id, "rank": self.rank, "files": meta}
        self.store.put_bytes(part_key(staged.prefix, self.rank), json.dumps(marker).encode())
        if self.rank != 0:
            return None, sum(int(m["bytes"]) for m in meta.values())
        total = self._commit(staged)
        log.info("sharded training checkpoint step %d committed to %s (%d ranks, %.2f s)", staged.step,
                 self.index.uri(staged.prefix), self.world_size, time.perf_counter() - t0)
        return None, total

    def _cleanup(self, staged: _Staged | None) -> None:
        if staged is None:
            return
        for path in staged.files:
            path.unlink(missing_ok=True)
        if self.rank == 0:
            shutil.rmtree(staged.folder, ignore_errors=True)
            if staged.folder.parent != self.staging_dir:  # DeepSpeed's <save>/<tag>/ layout: the save folder too
                shutil.rmtree(staged.folder.parent, ignore_errors=True)
            return
        try:
            staged.folder.rmdir()
        except OSError:
            pass  # other ranks' files (same node) are still there: they remove their own

    def _commit(self, staged: _Staged) -> int:
        """Rank 0: wait for every rank's marker of this save, write the manifest; returns the bytes committed."""
        step, prefix = staged.step, staged.prefix
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
                if marker.get("save_id") == staged.save_id:  # a stale marker from an interrupted attempt is ignored
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
        try:
            self.index.apply_retention()  # the same keep_last / debris rule as single-process saves
        except Exception as err:  # noqa: BLE001 - the new checkpoint is committed; pruning can wait
            log.warning("training checkpoint step %d is committed, but removing older ones failed (%s)", step, err)
        return sum(int(f["bytes"]) for f in files.values())


def load_into(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load weights and optimizer state (resharded to this world size) and return (state.json, this rank's
    RNG payload or None when the checkpoint had fewer ranks). Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((folder / STATE_FILE).read_text())
    msd, osd = get_state_dict(model, optimizer)
    target = {"model": msd, "optim": osd["state"]}
    load_planner, _ = tensor_only_planners()
    try:
        dcp.load(target, storage_reader=dcp_reader(folder), planner=load_planner())
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
