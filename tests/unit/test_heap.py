"""While the loop trains, the memory a step frees stays mapped: later steps take no page faults (glibc)."""

from __future__ import annotations

import resource
import statistics

import pytest
import torch

from memfit import config
from memfit.checkpoints import CheckpointManager
from memfit.data.prepare import DataBundle
from memfit.run_context import configured_plan
from memfit.runtime.env import DEFAULT_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, _glibc
from memfit.storage.local import LocalStore
from memfit.training.loop import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.skipif(_glibc() is None, reason="glibc's allocator only")]


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


def test_steps_after_the_first_take_no_page_faults(tmp_path, monkeypatch):
    """The same fit twice in this process: first under glibc's default thresholds (set explicitly: an earlier test
    in this worker may have left memfit's), then under memfit's loop. Compared in one process, because a worker that
    has run many tests takes some faults a step whatever the heap policy (Python's own arenas come and go: medians
    of 17-128 seen in a full run, 0-1 alone), while the defaults cost thousands."""
    from memfit.training import loop

    libc = _glibc()

    def glibc_defaults():
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        return lambda: None

    with monkeypatch.context() as patch:
        patch.setattr(loop, "keep_heap", glibc_defaults)
        default = statistics.median(_faults_per_step(tmp_path / "defaults"))
    kept = statistics.median(_faults_per_step(tmp_path / "memfit"))
    assert default >= 256, default  # the comparison means something: the defaults re-fault a megabyte a step
    assert kept <= default / 8, (kept, default)
