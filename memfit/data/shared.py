"""Prepared rows shared through the checkpoint store, so a new machine of the same run downloads them once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from memfit.config import MemfitConfig

log = logging.getLogger("memfit.data")
PREFIX = "data-cache"  # beside the step-N/ checkpoints; the checkpoint index reads only step prefixes


def shared_store(cfg: MemfitConfig) -> Any:
    """The checkpoint store when it is remote (a local folder is on this machine: the local cache serves)."""
    from memfit.storage import is_remote, open_checkpoint_store

    return open_checkpoint_store(cfg) if is_remote(cfg.checkpoint.uri) else None


def fetch(store: Any, key: str, dest: Path) -> bool:
    """Download the prepared folder `key` into `dest` (meta.json last, as it was uploaded last); False when the
    store has none or it cannot be read (the rows are then prepared here)."""
    from memfit.storage import StorageError

    if store is None:
        return False
    try:
        if not store.exists(f"{PREFIX}/{key}/meta.json"):
            return False
        for name in store.list(f"{PREFIX}/{key}/"):
            store.get_file(name, dest / name.rsplit("/", 1)[1])
        return (dest / "meta.json").is_file()
    except (StorageError, OSError) as err:
        log.warning("data: could not download the prepared rows %s from %s (%s): preparing them here", key,
                    store.describe(), err)
        return False


def share(store: Any, key: str, folder: Path) -> None:
    """Upload a prepared folder (rows first, meta.json last: a reader that sees meta.json sees them all)."""
    from memfit.storage import StorageError

    if store is None:
        return
    try:
        if store.exists(f"{PREFIX}/{key}/meta.json"):
            return
        files = sorted(folder.iterdir(), key=lambda p: p.name == "meta.json")
        for path in files:
            store.put_file(path, f"{PREFIX}/{key}/{path.name}")
        log.info("data: prepared rows shared in %s/%s/%s", store.describe(), PREFIX, key)
    except (StorageError, OSError) as err:
        log.warning("data: could not share the prepared rows in %s (%s); a new machine prepares them again",
                    store.describe(), err)
