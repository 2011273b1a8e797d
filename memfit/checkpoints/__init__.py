"""Training checkpoints (state to resume from, not gradient checkpointing): format, index, writer, reader."""

from memfit.checkpoints.format import (
    CONFIG_FILE,
    MANIFEST,
    CheckpointEntry,
    CheckpointInfo,
    LoadedCheckpoint,
    Snapshot,
    take_snapshot,
)
from memfit.checkpoints.index import CheckpointIndex
from memfit.checkpoints.manager import CheckpointManager
from memfit.checkpoints.reader import read_checkpoint_folder

__all__ = ["CONFIG_FILE", "MANIFEST", "CheckpointEntry", "CheckpointIndex", "CheckpointInfo", "CheckpointManager",
           "LoadedCheckpoint", "Snapshot", "read_checkpoint_folder", "take_snapshot"]
