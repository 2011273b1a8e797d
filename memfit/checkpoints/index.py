"""The training checkpoints in a store: listing, retention (keep_last, debris), download with verification."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from memfit.checkpoints.format import (
    FORMAT,
    MANIFEST,
    SHARDED_FORMAT,
    STEP_DIR,
    CheckpointEntry,
    CheckpointInfo,
    LoadedCheckpoint,
    step_prefix,
)
from memfit.checkpoints.reader import read_checkpoint_folder
from memfit.errors import CheckpointError
from memfit.files import sha256_file
from memfit.storage.base import ObjectStore

log = logging.getLogger("memfit.checkpoints")
# A DeepSpeed save commits with the sharded format in its manifest; its state.json says DeepSpeed.
_MANIFEST_FORMATS = (FORMAT, SHARDED_FORMAT)


class CheckpointIndex:
    """`step-NNNNNNNN/` folders under one store; a folder exists as a checkpoint once its manifest does."""

    def __init__(self, store: ObjectStore, keep_last: int = 2) -> None:
        self.store, self.keep_last = store, keep_last

    def uri(self, prefix: str) -> str:
        return f"{self.store.uri.rstrip('/')}/{prefix}"

    def _step_prefixes(self) -> list[tuple[int, str]]:
        seen: dict[int, str] = {}
        for key in self.store.list(""):
            m = STEP_DIR.match(key)
            if m:
                seen[int(m.group(1))] = f"step-{m.group(1)}"
        return sorted(seen.items())

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest exists and parses, oldest first (contents not yet verified)."""
        out = []
        for step, prefix in self._step_prefixes():
            try:
                manifest = json.loads(self.store.get_bytes(f"{prefix}/{MANIFEST}"))
            except Exception:  # noqa: BLE001 - missing or unreadable manifest: not a checkpoint
                continue
            if manifest.get("format") not in _MANIFEST_FORMATS or manifest.get("step") != step:
                continue
            out.append(CheckpointInfo(step=step, prefix=prefix, uri=self.uri(prefix), files=manifest["files"],
                                      created_at=manifest.get("created_at")))
        return out

    def latest_uri(self) -> str | None:
        complete = self.list()
        return complete[-1].uri if complete else None

    def scan(self) -> list[CheckpointEntry]:
        """Every step folder in the store, oldest first: complete (a valid manifest) or incomplete (debris)."""
        complete = {c.step: c for c in self.list()}
        keys: dict[int, int] = {}
        for key in self.store.list(""):
            m = STEP_DIR.match(key)
            if m:
                keys[int(m.group(1))] = keys.get(int(m.group(1)), 0) + 1
        out = []
        for step in sorted(keys):
            prefix = step_prefix(step)
            info = complete.get(step)
            out.append(CheckpointEntry(step=step, prefix=prefix, uri=self.uri(prefix), objects=keys[step],
                                       status="complete" if info else "incomplete", info=info))
        return out

    def apply_retention(self) -> None:
        """Keep the newest keep_last complete checkpoints; remove older ones and debris of interrupted saves."""
        complete = self.list()
        keep = {c.prefix for c in complete[-self.keep_last:]}
        newest = complete[-1].step if complete else -1
        for c in complete[:-self.keep_last]:
            # Manifest first: a checkpoint half-deleted must look incomplete, never complete-but-broken.
            self.store.delete(f"{c.prefix}/{MANIFEST}")
            self.store.delete_prefix(f"{c.prefix}/")
        for step, prefix in self._step_prefixes():
            if prefix not in keep and step < newest and not self.store.exists(f"{prefix}/{MANIFEST}"):
                self.store.delete_prefix(f"{prefix}/")  # debris of an interrupted save

    # -- reading ----------------------------------------------------------------------------------------
    def download_verified(self, info: CheckpointInfo, dest: Path) -> Path:
        """Download every file of `info` into dest and check sizes and sha256 against its manifest."""
        dest.mkdir(parents=True, exist_ok=True)
        for name, meta in info.files.items():
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{info.uri}: manifest names an unsafe file {name!r}")
            local = dest / name
            try:
                self.store.get_file(f"{info.prefix}/{name}", local)
            except Exception as err:  # noqa: BLE001
                raise CheckpointError(f"{info.uri}/{name}: cannot download ({err})") from None
            size = local.stat().st_size
            if size != int(meta["bytes"]):
                raise CheckpointError(f"{info.uri}/{name}: {size} bytes, manifest says {meta['bytes']}")
            if sha256_file(local) != meta["sha256"]:
                raise CheckpointError(f"{info.uri}/{name}: sha256 does not match the manifest")
        return dest

    def verify(self, info: CheckpointInfo, dest: Path) -> str | None:
        """Download and check one checkpoint (checksums, then a read that unpickles nothing); None if it is sound."""
        target = dest / info.prefix
        try:
            read_checkpoint_folder(self.download_verified(info, target), info)
            return None
        except CheckpointError as err:
            return str(err)
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def load(self, info: CheckpointInfo, dest: Path) -> LoadedCheckpoint:
        return read_checkpoint_folder(self.download_verified(info, dest), info)

    def latest(self, dest: Path) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies; corrupt or partial ones are skipped with a warning."""
        for info in reversed(self.list()):
            target = dest / info.prefix
            try:
                return self.load(info, target)
            except CheckpointError as err:
                log.warning("skipping training checkpoint %s: %s", info.uri, err)
                shutil.rmtree(target, ignore_errors=True)
        return None
