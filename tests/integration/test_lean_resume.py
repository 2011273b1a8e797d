"""Each optimizer option, the chunked loss, lean layers and dropout resume bitwise: SIGKILLed after a save, rerun."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from tests_support import tiny_overrides
from torch import nn

from memfit.checkpoints.format import step_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts, not a package
import kill_child  # noqa: E402

pytestmark = pytest.mark.integration
TINY = kill_child.TINY
# Killed as soon as the step-4 training checkpoint commits: its save overlaps steps 5-6 (the writer thread works
# while training goes on) and the next save is the last one, so the kill lands mid-way into a later step.
MAX_STEPS, EVERY = 8, 4

OPTIONS = {
    "adamw": {"memory.optimizer": "adamw"},
    "adamw-fused": {"memory.optimizer": "adamw-fused"},
    "adamw-8bit": {"memory.optimizer": "adamw-8bit"},
    "step-in-backward": {"memory.optimizer_in_backward": "true", "train.max_grad_norm": "null",
                         "train.grad_accum_steps": 1},
    "chunked-loss": {"memory.loss": "chunked", "memory.loss_chunk_tokens": 100},
    # Dropout draws from torch's RNG every step: the resumed run matches only if the RNG state is restored.
    "lora-dropout": {"lora.enabled": "true", "lora.dropout": 0.1},
    "lean-layers": {"memory.lean_layers": "true"},
    "adamw-cpu-offload": {"memory.optimizer": "adamw-cpu-offload", "train.device": "cuda"},
}
NEEDS = {"adamw-8bit": "bitsandbytes", "adamw-cpu-offload": "torchao"}
# What each option's own code records when the run goes through it (not only that it was configured).
MARKER = {"adamw": "AdamW", "adamw-fused": "fused", "adamw-8bit": "AdamW8bit", "step-in-backward": "hook",
          "chunked-loss": "chunked", "lora-dropout": "AdamW", "lean-layers": "lean",
          "adamw-cpu-offload": "OffloadedAdamW"}
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="adamw-cpu-offload needs CUDA")]


def _start(option: str) -> str:
    """How a child starts: a CUDA run's by spawn (CUDA cannot start in a fork of a process that initialised it)."""
    return "spawn" if OPTIONS[option].get("train.device") == "cuda" else "forkserver"


@pytest.fixture(autouse=True, scope="module")
def _fork_server():
    yield
    kill_child.stop_fork_server()


def _overrides(root: Path, option: str) -> list[str]:
    return tiny_overrides(root, **{"train.max_steps": MAX_STEPS, "checkpoint.every_steps": EVERY,
                                   "train.warmup_steps": 2, "data.synthetic_docs": 400, "export.onnx": False,
                                   "tracking.backend": "null", "train.num_threads": 1, **OPTIONS[option]})


def _straight(option: str, tmp_path: Path) -> Path:
    """The uninterrupted run, in a child of its own like the killed one (no thread of this test process touches
    its RNG), through the same function; its final training checkpoint."""
    child = kill_child.TrainChild(TINY, _overrides(tmp_path / "straight", option), tmp_path, "straight", spy=True,
                                  start=_start(option))
    straight = child.finish(timeout=300)
    assert straight is not None, f"the uninterrupted run failed:\n{child.log[-3000:]}"
    assert straight["final_train_loss"] < straight["initial_val_loss"]  # it trains, as the default does
    used = straight["code_used"]
    assert MARKER[option] in used, f"{option} was not what the run used: {used[:3]}"
    return tmp_path / "straight" / "checkpoints" / step_prefix(MAX_STEPS)


def _killed_and_rerun(option: str, tmp_path: Path, watch: str, **env: str) -> tuple[list[int], list[str], Path]:
    """Run in a child, SIGKILL it the moment `watch` (a path in the store) exists, rerun the same command in
    another child to the end; (the steps committed when it was killed, the store's files then, the rerun's final
    training checkpoint)."""
    root = tmp_path / "killed"
    command = (TINY, _overrides(root, option))
    first = kill_child.TrainChild(*command, tmp_path, "killed", env=env, start=_start(option))
    try:
        seen = first.wait_for_path(root / "checkpoints" / watch)
        code = first.kill()
    finally:
        first.kill()
    assert seen is not None, f"{watch} never appeared:\n{first.log[-3000:]}"
    assert code == -signal.SIGKILL, f"the run ended (exit {code}) before the kill:\n{first.log[-3000:]}"
    left = kill_child.complete_steps(root / "checkpoints")
    held = sorted(str(p.relative_to(root / "checkpoints")) for p in (root / "checkpoints").rglob("*") if p.is_file())

    rerun = kill_child.TrainChild(*command, tmp_path, "rerun", start=_start(option))
    resumed = rerun.finish(timeout=300)
    assert resumed is not None, f"the rerun failed:\n{rerun.log[-3000:]}"
    assert resumed["resumed_from"] == (left[-1] if left else None), resumed  # from the newest one committed
    assert resumed["steps"] == MAX_STEPS, resumed
    return left, held, root / "checkpoints" / step_prefix(MAX_STEPS)


@pytest.mark.parametrize("option", [*(o for o in OPTIONS if o != "adamw-cpu-offload"),
                                    pytest.param("adamw-cpu-offload", marks=ON_CUDA)])
def test_sigkilled_after_a_committed_training_checkpoint_and_rerun_ends_bitwise_equal(option, tmp_path):
    if option in NEEDS:
        pytest.importorskip(NEEDS[option])
    straight = _straight(option, tmp_path)
    left, _, final = _killed_and_rerun(option, tmp_path, f"{step_prefix(EVERY)}/manifest.json")
    assert left and EVERY <= left[-1] < MAX_STEPS, f"committed when killed: {left}"
    diffs = kill_child.training_checkpoint_differences(straight, final)
    assert not diffs, f"{option}: resumed run differs from the uninterrupted one: {diffs[:5]}"
    if option == "lora-dropout":  # adapters trained, and the RNG state compared above moved on from its seed
        from memfit.checkpoints.reader import read_checkpoint_folder

        ckpt = read_checkpoint_folder(final)
        assert any("lora_A" in k for k in ckpt.model_state)
        assert not torch.equal(ckpt.rng_tensors["torch"], torch.Generator().manual_seed(42).get_state())


def test_sigkilled_mid_upload_the_half_written_checkpoint_is_never_used(tmp_path):
    """Killed while the first training checkpoint's files are uploading (its manifest not yet written): the rerun
    starts from scratch over that folder and still ends bitwise equal."""
    option = "adamw-8bit" if _has("bitsandbytes") else "adamw"  # 8-bit: the optimizer file unlike the others
    straight = _straight(option, tmp_path)
    half = step_prefix(EVERY)
    left, held, final = _killed_and_rerun(option, tmp_path, f"{half}/model.safetensors", MEMFIT_TEST_UPLOAD_DELAY="0.3")
    assert left == [] and f"{half}/model.safetensors" in held and f"{half}/manifest.json" not in held, held
    assert not kill_child.training_checkpoint_differences(straight, final)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- each optimizer's state through the training checkpoint format, without pickle -----------------------
ROUND_TRIP = {"adamw": ("adamw", False), "adamw-fused": ("adamw-fused", False), "adamw-8bit": ("adamw-8bit", False),
              "step-in-backward": ("adamw", True), "adamw-cpu-offload": ("adamw-cpu-offload", False)}


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)  # 2-D weights of >= 4096 elements: bitsandbytes keeps their state in 8 bits
    return nn.Sequential(nn.Embedding(384, 64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 384)).to(device)


def _optimizer(model: nn.Module, kind: str, in_backward: bool) -> tuple[torch.optim.Optimizer, object]:
    from memfit.memory.techniques import optim

    opt = optim.make_adamw(model, 1e-2, 0.1, kind=kind)
    return opt, optim.StepInBackward(opt) if in_backward else None


def _step(model: nn.Module, opt: torch.optim.Optimizer, hooks, i: int) -> None:
    x = torch.arange(i, i + 32).remainder(384).view(4, 8).to(next(model.parameters()).device)
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1).flatten()).backward()
    if hooks is None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        hooks.finish()


def _param_states(optimizer_state) -> list[dict]:
    """Each parameter's state, in torch's layout (torchao's CPU offload too: memfit's OffloadedAdamW writes it)."""
    return list(optimizer_state["state"].values())


@pytest.mark.parametrize("option", [*(o for o in ROUND_TRIP if o != "adamw-cpu-offload"),
                                    pytest.param("adamw-cpu-offload", marks=ON_CUDA)])
def test_optimizer_state_round_trips_through_the_training_checkpoint_format(option, tmp_path):
    from memfit.checkpoints.format import take_snapshot
    from memfit.checkpoints.manager import write_local
    from memfit.checkpoints.reader import read_checkpoint_folder

    kind, in_backward = ROUND_TRIP[option]
    if kind in NEEDS:
        pytest.importorskip(NEEDS[kind])
    device = "cuda" if kind == "adamw-cpu-offload" else "cpu"
    model = _model(device)
    opt, hooks = _optimizer(model, kind, in_backward)
    for i in range(3):
        _step(model, opt, hooks, i)
    saved = opt.state_dict()
    write_local(take_snapshot(3, model.state_dict(), saved, {"torch": torch.get_rng_state()}, {"step": 3}, ""),
                tmp_path)
    loaded = read_checkpoint_folder(tmp_path)  # weights_only torch.load: any pickled object would be refused
    states = _param_states(loaded.optimizer_state)
    assert len(states) == len(list(model.parameters())) and all(s["step"] == 3 for s in states)  # every one stepped
    if kind == "adamw-8bit":  # bitsandbytes' own layout: 8-bit moments, their quantization maps and block scales
        quant = [s["__bnb_optimizer_quant_state__"] for s in states]
        eight = [q for q in quant if q["state1"].dtype == torch.uint8]
        assert len(eight) == 3 and all({"qmap1", "qmap2", "absmax1", "absmax2"} <= q.keys() for q in eight)

    fresh = _model(device)
    fresh.load_state_dict(dict(loaded.model_state))
    again, again_hooks = _optimizer(fresh, kind, in_backward)
    again.load_state_dict(loaded.optimizer_state)
    assert kill_child.state_differences(saved, again.state_dict()) == []
    # And the next step is the same step: what a resumed run takes after the checkpoint.
    _step(model, opt, hooks, 3)
    _step(fresh, again, again_hooks, 3)
    assert kill_child.state_differences(model.state_dict(), fresh.state_dict()) == []
