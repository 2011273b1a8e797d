"""Live-bytes counting, a step's timeline and its per-module rows, on small hand-built models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.memory.estimator.breakdown import TOP_LEVEL, module_rows, summarize
from memfit.memory.estimator.timeline import LiveBytes, StepTimeline

pytestmark = pytest.mark.unit


def test_live_bytes_counts_storages_once_and_follows_releases():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20]
        a.add_(1)  # in place: same storage
        b = a * 2  # a new 4000 bytes
        assert live.current == 8000
        del b
        assert live.current == 4000 and live.peak == 8000
        del a, view
        assert live.current == 0
    x = torch.ones(10)
    live.adopt([x], "parameter")
    assert live.current == 40


class Block(nn.Module):
    def __init__(self, d: int, recompute: bool) -> None:
        super().__init__()
        self.up, self.down, self.recompute = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), recompute

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._f, x, use_reentrant=False) if self.recompute and self.training else self._f(x)


class Toy(nn.Module):
    def __init__(self, recompute: bool = False, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d, recompute) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


def _record(recompute: bool) -> tuple[dict, StepTimeline]:
    torch.manual_seed(0)
    model = Toy(recompute)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 32)
    for _ in range(2):  # the first step creates the optimizer state; record a steady one
        tl = StepTimeline(model)
        tl.adopt(list(model.parameters()), "parameter")
        tl.adopt([v for s in opt.state.values() for v in s.values()], "optimizer")
        with tl:
            model(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    tl.classify()
    return summarize(tl, model, opt), tl


def test_timeline_categories_phases_and_modules():
    s, tl = _record(recompute=False)
    n_param_bytes = sum(p.numel() * 4 for p in Toy().parameters())
    assert s["after_forward"]["parameter"] == n_param_bytes
    assert s["after_forward"]["optimizer"] >= 2 * n_param_bytes  # exp_avg + exp_avg_sq
    assert s["allocated_bytes"]["gradient"] == n_param_bytes
    assert len(tl.forward_spans) == 1 and len(tl.backward_spans) == 1 and len(tl.optimizer_spans) == 1
    # Each block keeps its relu output (64 x 128 floats) for backward, and its output for the next block.
    rows = {r["module"]: r for r in s["modules"]}
    assert set(rows) >= {"embed", "layers.0", "layers.1", "layers.2", "head"}
    assert rows["layers.1"]["activation_bytes"] >= 64 * 128 * 4 + 64 * 32 * 4
    assert rows["layers.1"]["params_bytes"] == (32 * 128 + 128 + 128 * 32 + 32) * 4
    assert sum(r["activation_bytes"] for r in s["modules"]) == s["activation_bytes_after_forward"]
    # The peak is in backward (gradients appear while activations are still alive) and memory falls after it.
    assert s["peak_at"]["phase"] in ("backward", "forward")
    curve = s["timeline"]["total"]
    assert curve[-1] < max(curve)


def test_recompute_lowers_the_activation_peak_and_shows_in_backward():
    plain, _ = _record(recompute=False)
    ckpt, tl = _record(recompute=True)
    assert ckpt["allocated_bytes"]["recompute"] > 0 and plain["allocated_bytes"]["recompute"] == 0
    assert ckpt["activation_bytes_after_forward"] < plain["activation_bytes_after_forward"] / 2
    assert ckpt["peak_activation_bytes"] < plain["peak_activation_bytes"]
    rows = {r["module"]: r for r in ckpt["modules"]}
    assert rows["layers.0"]["recomputed_bytes"] > 0
    assert any(a.phase == "recompute" for a in tl.allocs)


def test_module_rows_put_blocks_of_a_layer_stack_in_one_row():
    rows = module_rows(Toy())
    assert rows["layers.2.up"] == "layers.2" and rows["layers.0"] == "layers.0"
    assert rows["embed"] == "embed" and rows["head"] == "head" and rows[""] == TOP_LEVEL


def test_profile_names_a_bad_compare_entry_and_steps(tmp_path):
    from memfit.config import load
    from memfit.errors import ConfigError
    from memfit.profile import profile

    cfg = load(None, [f"run.work_dir={tmp_path / 'work'}"])
    with pytest.raises(ConfigError, match="--compare bogus: .*unknown policy"):
        profile(cfg, out_dir=tmp_path / "out", compare=["none", "bogus"])
    with pytest.raises(ConfigError, match="--steps 1"):
        profile(cfg, out_dir=tmp_path / "out", steps=1)


def test_a_dtensor_counts_as_the_shard_this_rank_holds():
    """FSDP2's parameters, gradients and optimizer state are DTensors, whose storage reports the global size: counted
    so, an FSDP2 rank of two read its state twice over. A fake process group of two: no other process starts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        shard = DTensor.from_local(torch.ones(256, 64), init_device_mesh("cpu", (2,)), [Shard(0)], run_check=False)
        assert tuple(shard.shape) == (512, 64) and shard.untyped_storage().nbytes() == 512 * 64 * 4
        live = LiveBytes(torch.device("cpu"))
        live.adopt([shard], "parameter")
        assert live.current == 256 * 64 * 4  # this rank's half
        with live:
            doubled = shard * 2  # a DTensor the step makes: its local shard too
        assert live.peak == 2 * 256 * 64 * 4 and isinstance(doubled, DTensor)
    finally:
        dist.destroy_process_group()
