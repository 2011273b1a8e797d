"""adamw-cpu-offload's state in torch's layout: `.state` per parameter, a training checkpoint that resumes bitwise.

torchao's CPUOffloadOptimizer needs CUDA and pinned memory (its constructor asserts a CUDA or XPU device), so on
a CPU machine the layout is tested on a stand-in with its structure: one host-side AdamW per large parameter over
a copy of it (`optim_dict`, `param_d2h_map`), one on-device AdamW for the small ones (`d_opt`), no `.state`, the
groups' "params" popped. The real optimizer goes through the same checks in
tests/integration/test_lean_resume.py (gpu-marked).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.memory.techniques.offload_optim import TorchStateLayout
from memfit.memory.techniques.optim import ADAMW_BETAS, param_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kill_child  # noqa: E402

HYPER = {"lr": 1e-2, "betas": ADAMW_BETAS, "eps": 1e-8, "fused": True}


class StandIn(TorchStateLayout, torch.optim.Optimizer):
    """CPUOffloadOptimizer's structure and step, with plain CPU copies for its pinned host tensors."""

    def __init__(self, groups: list[dict], minimal_size: int = 4096) -> None:
        self.optim_dict, self.param_d2h_map, self.d_param_groups = {}, {}, []
        for group in [dict(g) for g in groups]:
            retained = []
            for p in group.pop("params"):
                if p.numel() < minimal_size:
                    retained.append(p)
                    continue
                host = p.detach().clone()
                host.grad = torch.empty_like(host)
                self.param_d2h_map[p] = host
                self.optim_dict[p] = torch.optim.AdamW([{"params": host, **group}], **HYPER)
            if retained:
                self.d_param_groups.append({"params": retained, **group})
        self.d_opt = torch.optim.AdamW(self.d_param_groups, **HYPER) if self.d_param_groups else None
        self._remember_groups(groups)

    @property
    def param_groups(self):  # torchao's: the on-device groups, then one group per offloaded parameter
        return sum((o.param_groups for o in self.optim_dict.values()), start=self.d_param_groups)

    def step(self, closure=None):
        if self.d_opt is not None:
            self.d_opt.step()
        for p, opt in self.optim_dict.items():
            if p.grad is not None:
                host = self.param_d2h_map[p]
                host.grad.copy_(p.grad)
                opt.step()
                p.data.copy_(host)

    def zero_grad(self, set_to_none: bool = True) -> None:  # the device gradients (host ones are overwritten)
        for p in self.optim_dict:
            p.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=True)


def _model() -> nn.Module:
    torch.manual_seed(0)  # embedding and projections >= 4096 values (offloaded), biases and norm on the device
    return nn.Sequential(nn.Embedding(384, 64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 384))


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.arange(i, i + 32).remainder(384).view(4, 8)
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1).flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_the_state_reads_as_torch_adamw_writes_it_for_the_same_groups():
    ours, theirs = _model(), _model()
    offloaded = StandIn(param_groups(ours, 0.1))
    plain = torch.optim.AdamW(param_groups(theirs, 0.1), **HYPER)
    assert not hasattr(torch.optim.Optimizer, "state")  # what torchao lacks: memfit's profile reads it
    for i in range(3):
        _step(ours, offloaded, i)
        _step(theirs, plain, i)
    assert offloaded.optim_dict and offloaded.d_opt is not None  # both halves exercised
    a, b = offloaded.state_dict(), plain.state_dict()
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]
    assert kill_child.state_differences(a["state"], b["state"]) == []
    assert list(offloaded.state) == [p for g in param_groups(ours, 0.1) for p in g["params"]]
    assert all(s["exp_avg"].shape == p.shape for p, s in offloaded.state.items())


def test_the_state_round_trips_through_a_training_checkpoint_bitwise(tmp_path):
    from memfit.checkpoints.format import take_snapshot
    from memfit.checkpoints.manager import write_local
    from memfit.checkpoints.reader import read_checkpoint_folder

    model = _model()
    opt = StandIn(param_groups(model, 0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # the schedule writes each group's lr
    for i in range(3):
        _step(model, opt, i)
        sched.step()
    saved = opt.state_dict()
    write_local(take_snapshot(3, model.state_dict(), saved, {"torch": torch.get_rng_state()}, {"step": 3}, ""),
                tmp_path)
    loaded = read_checkpoint_folder(tmp_path)  # weights_only: nothing pickled
    assert all(s["step"] == 3 for s in loaded.optimizer_state["state"].values())

    fresh = _model()
    fresh.load_state_dict(dict(loaded.model_state))
    again = StandIn(param_groups(fresh, 0.1))
    again.load_state_dict(loaded.optimizer_state)
    assert kill_child.state_differences(saved, again.state_dict()) == []
    _step(model, opt, 3)
    _step(fresh, again, 3)
    assert kill_child.state_differences(model.state_dict(), fresh.state_dict()) == []


def test_a_state_of_other_groups_is_refused():
    opt = StandIn(param_groups(_model(), 0.1))
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 1.0, "params": [0]}]})
