"""torchao's CPU-offloaded AdamW behind torch's optimizer interface: `.state` per parameter, torch's state layout."""

from __future__ import annotations

import functools
from typing import Any

import torch

# torchao's CPUOffloadOptimizer keeps one host-side AdamW per large parameter (`optim_dict`, keyed by the device
# parameter, over its pinned copy in `param_d2h_map`) and one on-device AdamW for the small ones (`d_opt`); it never
# calls Optimizer.__init__, so it has no `.state`, and its state dict is {"offloaded": [...], "on-device": {...}}.
# memfit reads `.state` (profile, breakdown) and compares and resumes training checkpoints in torch's positional
# layout, so the mixin below gives it both; a checkpoint of adamw-cpu-offload then reads like adamw's.


class TorchStateLayout:
    """Mixin over an object with CPUOffloadOptimizer's attributes (optim_dict, param_d2h_map, d_opt): torch's
    `.state` and `state_dict()` / `load_state_dict()` layout, positional over the parameter groups it was given."""

    optim_dict: dict[torch.Tensor, torch.optim.Optimizer]
    param_d2h_map: dict[torch.Tensor, torch.Tensor]
    d_opt: torch.optim.Optimizer | None
    _memfit_groups: list[tuple[list[torch.Tensor], dict[str, Any]]]

    def _remember_groups(self, groups: list[dict[str, Any]]) -> None:
        """The groups as given (before torchao splits them): their order is the checkpoint's parameter ids."""
        self._memfit_groups = [(list(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in groups]

    def _inner(self, p: torch.Tensor) -> tuple[torch.optim.Optimizer | None, torch.Tensor]:
        """The optimizer that steps `p` and the tensor its state is keyed by (the host copy when offloaded)."""
        if p in self.optim_dict:
            return self.optim_dict[p], self.param_d2h_map[p]
        return self.d_opt, p

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """Each device parameter's AdamW state (host tensors for the offloaded ones); none before its first step."""
        out = {}
        for params, _ in self._memfit_groups:
            for p in params:
                opt, key = self._inner(p)
                if opt is not None and opt.state.get(key):
                    out[p] = opt.state[key]
        return out

    def _group_of(self, p: torch.Tensor) -> dict[str, Any] | None:
        opt, key = self._inner(p)
        if opt is None:
            return None
        return next((g for g in opt.param_groups if any(q is key for q in g["params"])), None)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """{"state": {id: state}, "param_groups": [{hyper-parameters, "params": [ids]}]}, as torch's AdamW writes
        for the same groups; a group's hyper-parameters (lr as the schedule set it) are those of its inner groups."""
        state, groups, index, current = {}, [], 0, self.state
        for params, given in self._memfit_groups:
            inner = next((g for g in map(self._group_of, params) if g is not None), None)
            hyper = {k: v for k, v in (inner or given).items() if k != "params"}
            ids = list(range(index, index + len(params)))
            state.update({i: dict(current[p]) for i, p in zip(ids, params, strict=True) if p in current})
            groups.append({**hyper, "params": ids})
            index += len(params)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """The inverse of `state_dict`: each inner optimizer gets its parameters' state and their group's
        hyper-parameters, in torch's layout, through its own load_state_dict (dtype and device handled there)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(p) for p, _ in self._memfit_groups]:
            raise ValueError("the saved optimizer state's parameter groups do not match this model's")
        per: dict[torch.Tensor, tuple[dict[str, Any] | None, dict[str, Any]]] = {}
        for (params, _), saved in zip(self._memfit_groups, saved_groups, strict=True):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            for p, i in zip(params, saved["params"], strict=True):
                per[p] = (state_dict["state"].get(i), hyper)
        for p, opt in self.optim_dict.items():
            s, hyper = per[p]
            opt.load_state_dict({"state": {0: s} if s else {}, "param_groups": [{**hyper, "params": [0]}]})
        if self.d_opt is not None:
            state, groups, k = {}, [], 0
            for g in self.d_opt.param_groups:
                ids = []
                for p in g["params"]:
                    if per[p][0]:
                        state[k] = per[p][0]
                    ids.append(k)
                    k += 1
                groups.append({**per[g["params"][0]][1], "params": ids})
            self.d_opt.load_state_dict({"state": state, "param_groups": groups})


@functools.cache
def _offloaded_class() -> type:
    from torchao.optim import CPUOffloadOptimizer  # lazy: torchao is optional (the gpu extra)

    return type("OffloadedAdamW", (TorchStateLayout, CPUOffloadOptimizer), {"__module__": __name__})


def make_offloaded_adamw(groups: list[dict[str, Any]], offload_gradients: bool, **hyper: Any) -> torch.optim.Optimizer:
    """torchao's CPUOffloadOptimizer over AdamW (fused on the CPU), with torch's state interface."""
    # torchao pops "params" out of each group it is given: it gets copies, the originals keep the order.
    opt = _offloaded_class()([dict(g) for g in groups], torch.optim.AdamW, offload_gradients=offload_gradients,
                             fused=True, **hyper)
    opt._remember_groups(groups)
    return opt
