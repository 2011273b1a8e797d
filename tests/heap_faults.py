"""Page faults a step of a tiny fit, under glibc's default thresholds and under memfit's loop (a fresh process)."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from memfit import config
from memfit.checkpoints import CheckpointManager
from memfit.data.prepare import DataBundle
from memfit.run_context import configured_plan
from memfit.runtime.env import DEFAULT_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, _glibc
from memfit.storage.local import LocalStore
from memfit.training.loop import Trainer


class FaultsPerStep:
    """A tracker that notes the training thread's minor page faults each time a step logs (every step here): the
    thread that allocates and frees the step's tensors (OMP_NUM_THREADS=1 under the suite). The whole process's
    count took in other threads' faults (Prefect's event loop, servers left by earlier tests in the same worker):
    median 384 a step once in a full run, against a few alone; without keep_heap this count is still far above 64."""

    run_id = "run-1"

    def __init__(self) -> None:
        self.at: dict[int, int] = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.at[step] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def set_tags(self, tags: dict) -> None:
        pass

    def flush(self) -> None:
        pass


def _faults_per_step(tmp_path) -> list[int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # configs/tiny.yaml's shapes: a step allocates and frees megabytes.
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    cfg = config.load(None, [f"run.work_dir={tmp_path / 'work'}", f"checkpoint.uri={tmp_path / 'ckpt'}",
                             "train.batch_size=16", "train.grad_accum_steps=2", "train.max_steps=14",
                             "train.eval_batches=1", "train.device=cpu", "checkpoint.every_steps=100"])
    blocks = torch.randint(0, 384, (200, 64))
    data = DataBundle(train=blocks[:160], val=blocks[160:], digest="unit", n_train_tokens=160 * 64,
                      n_val_tokens=40 * 64, source="unit")
    tracker = FaultsPerStep()
    manager = CheckpointManager(LocalStore(str(tmp_path / "ckpt")), staging_dir=tmp_path / "staging")
    try:
        Trainer(cfg, configured_plan(cfg), model, data, torch.device("cpu"), tracker, manager, {}).fit()
    finally:
        manager.close()
    return [tracker.at[s + 1] - tracker.at[s] for s in range(4, 14)]  # steps 5-14: the heap has its peak


def compare(tmp_path: Path) -> dict[str, float]:
    """The same fit twice in this process: first under glibc's default thresholds (set explicitly), then under
    memfit's loop; the median faults a step of steps 5-14 of each. Run in a fresh process
    (tests/integration/test_heap_release.py): in a worker that had run many tests the defaults once took 0.5 faults
    a step (the heap's layout there), and memfit's loop 17-128 (Python's own arenas), so neither bound held there."""
    from memfit.training import loop

    libc = _glibc()

    def glibc_defaults():
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's initial mmap threshold
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        return lambda: None

    kept_heap, loop.keep_heap = loop.keep_heap, glibc_defaults
    try:
        default = statistics.median(_faults_per_step(tmp_path / "defaults"))
    finally:
        loop.keep_heap = kept_heap
    return {"default": default, "kept": statistics.median(_faults_per_step(tmp_path / "memfit"))}


if __name__ == "__main__":
    print(json.dumps(compare(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))))
