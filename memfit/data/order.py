"""The resumable training order: which packed rows come next, restored at the exact batch from a checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import CheckpointError

MEGABATCH = 50  # micro-batches sorted together by length (the HF Trainer's group_by_length uses 50 too)


def grouped_permutation(perm: list[int], lengths: list[int], batch_size: int) -> list[int]:
    """Pure: a shuffled order regrouped so each micro-batch holds examples of similar length (little padding),
    still random at the scale of MEGABATCH micro-batches: each window of the permutation sorted longest first,
    so the first micro-batch of a window is its longest (an out-of-memory shows on the first step, not late)."""
    window = MEGABATCH * batch_size
    out: list[int] = []
    for start in range(0, len(perm), window):
        out.extend(sorted(perm[start:start + window], key=lambda i: (-lengths[i], i)))
    return out


class BatchOrder:
    """Which training blocks come next; its state_dict resumes the order at the exact batch.

    `lengths` (one padded example a row): micro-batches are grouped by length (grouped_permutation)."""

    def __init__(self, n_items: int, batch_size: int, seed: int, lengths: list[int] | None = None) -> None:
        if n_items < 1 or batch_size < 1:
            raise ValueError(f"BatchOrder needs n_items >= 1 and batch_size >= 1 "
                             f"(got {n_items}, {batch_size})")
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self.lengths = lengths
        self._epoch = 0
        self._index = 0  # position inside the current epoch's permutation
        self._perm: list[int] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def _permutation(self) -> list[int]:
        # A fresh Generator per epoch: the order is a pure function of (seed, epoch), so resuming
        # needs no RNG state, and the global RNG is never touched.
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed + self._epoch)
            self._perm = torch.randperm(self.n_items, generator=gen).tolist()
            if self.lengths is not None:
                self._perm = grouped_permutation(self._perm, self.lengths, self.batch_size)
        return self._perm

    def next_indices(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            perm = self._permutation()
            take = perm[self._index:self._index + self.batch_size - len(out)]
            out.extend(take)
            self._index += len(take)
            if self._index >= self.n_items:  # roll into the next epoch mid-batch if needed
                self._epoch += 1
                self._index = 0
                self._perm = None
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "n_items": self.n_items,
                "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            n_items, seed = int(state["n_items"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"data order state in the checkpoint is malformed ({err!r}); "
                                  "start without resuming (checkpoint.resume=false)") from None
        if n_items != self.n_items or seed != self.seed:
            raise CheckpointError(
                f"the training data changed since the checkpoint (blocks {n_items} -> {self.n_items}, "
                f"seed {seed} -> {self.seed}); restore the same data/seeds or start a new run "
                "(checkpoint.resume=false or another checkpoint.uri)")
        if epoch < 0 or not 0 <= index < n_items:
            raise CheckpointError(f"data order state in the checkpoint is out of range (epoch {epoch}, "
                                  f"index {index} of {n_items})")
        # batch_size may change on resume: the position is counted in items, not batches.
        self._epoch, self._index, self._perm = epoch, index, None
