"""The training phase alone in a child process killed for real (SIGKILL), and training checkpoints compared bitwise."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")

# For the integration tier: no Prefect, no MLflow, no CLI start-up. These modules are imported once, by
# multiprocessing's fork server; each child is a fork of it, so it starts in a fraction of a
# second instead of the ~9 s these imports take on 2 cores. Missing optional ones (bitsandbytes) are skipped.
TRAIN_PRELOAD = ["kill_child", "memfit.phases", "memfit.training.loop", "memfit.models.loading",
                 "memfit.models.lora", "memfit.tracking.plots", "memfit.storage.s3", "memfit.checkpoints.manager",
                 "transformers.modeling_utils",
                 "transformers.models.llama.modeling_llama", "transformers.tokenization_utils_tokenizers",
                 "matplotlib.backends.backend_agg", "matplotlib.pyplot", "peft", "bitsandbytes"]


def train_phase(config_path: str, overrides: list[str]) -> dict:
    """What `memfit run` does between planning and evaluation, as a rerun does it: recover the newest verified
    training checkpoint (phase 4), then train to train.max_steps from it (phase 3); the TrainReport as a dict.
    The plan is fixed (no gradient checkpointing; the config's precision, batch and LoRA when lora.enabled is
    true): resume is under test, not planning."""
    from memfit import config, phases
    from memfit.run_context import configured_plan

    cfg = config.load(config_path, overrides)
    # The options under test (memory.optimizer, loss, lean layers, stepping in backward) as the config sets them.
    plan = configured_plan(cfg, "none", reason="kill trial")
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg), None).model_dump(mode="json")


def install_spies() -> list[str]:
    """Record, in the returned list, which technique's own code a run goes through: "hook" (the optimizer step in
    backward), "chunked" (the chunked loss), "lean" (a lean-layer MLP), and the optimizer made ("fused" or its
    class name). Patches memfit's modules in this process for good: for a child that ends with its run."""
    from memfit.memory.techniques import lean_layers, loss, optim

    used: list[str] = []
    step, call, make, mlp = (optim.StepInBackward._step, loss.ChunkedLoss.__call__, optim.make_adamw,
                             lean_layers.lean_mlp_forward)

    def spy_step(self, p):
        used.append("hook")
        step(self, p)

    def spy_call(self, model, batch):
        used.append("chunked")
        return call(self, model, batch)

    def spy_make(*args, **kwargs):
        opt = make(*args, **kwargs)
        name = type(opt).__name__  # torchao's offloaded AdamW steps fused AdamWs inside: its own name counts
        used.append("fused" if name == "AdamW" and any(g.get("fused") for g in opt.param_groups) else name)
        return opt

    def spy_mlp(self, x):
        if not used or used[-1] != "lean":
            used.append("lean")
        return mlp(self, x)

    lean_layers.lean_mlp_forward, optim.StepInBackward._step = spy_mlp, spy_step
    loss.ChunkedLoss.__call__, optim.make_adamw = spy_call, spy_make
    return used


def _train_child(config_path: str, overrides: list[str], log_path: str, report_path: str, env: dict[str, str],
                 spy: bool) -> None:
    os.environ.update(env)
    # The child's stdout, stderr and memfit's INFO log go to one file (the fork server's are the parent's).
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    used = install_spies() if spy else None
    report = train_phase(config_path, overrides)
    if used is not None:
        report["code_used"] = used
    Path(report_path).write_text(json.dumps(report))


_train_ctx = None


def _train_context(start: str = "forkserver"):
    """forkserver (preloaded, fast) or spawn: a CUDA run's child must not be a fork of a process that may have
    initialised CUDA (an import in the preload can), or CUDA refuses to start in it."""
    global _train_ctx
    import multiprocessing

    if start == "spawn":
        return multiprocessing.get_context("spawn")
    if _train_ctx is None:
        _train_ctx = multiprocessing.get_context("forkserver")
        _train_ctx.set_forkserver_preload(TRAIN_PRELOAD)
    return _train_ctx


def stop_fork_server() -> None:
    """End the fork server (it holds torch and transformers in memory, ~0.5 GB) once the trials are done; the next
    TrainChild starts a new one. multiprocessing has no public call for this; its own tests use `_stop`."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


class TrainChild:
    """`train_phase(config_path, overrides)` in a child process of its own; SIGKILL ends it as it would end
    `memfit run` (no handler, no atexit, the writer thread mid-way). Its log: `folder/NAME.log`; `env`: variables
    set in the child only (MEMFIT_TEST_UPLOAD_DELAY to land a kill mid-upload); `spy`: the report's "code_used" is
    what `install_spies` recorded. A child of the fork server shares no thread with the caller: a test process's
    leftover threads (Prefect's, botocore's retries) draw from Python's global `random`, whose state a training
    checkpoint holds, so an uninterrupted run to compare against runs in a child too. `start`: "spawn" for a run on
    CUDA (a fresh interpreter; slower to start, never a fork after CUDA is initialised)."""

    def __init__(self, config_path: str, overrides: list[str], folder: Path, name: str,
                 env: dict[str, str] | None = None, spy: bool = False, start: str = "forkserver") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path, self.report_path = folder / f"{name}.log", folder / f"{name}.json"
        self.report_path.unlink(missing_ok=True)
        self.proc = _train_context(start).Process(target=_train_child, name=f"memfit-train-{name}", daemon=True,
                                             args=(config_path, overrides, str(self.log_path), str(self.report_path),
                                                   env or {}, spy))
        self.t0 = time.monotonic()
        self.proc.start()

    @property
    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def wait_for_path(self, path: Path, timeout: float = 120) -> float | None:
        """Seconds since start when `path` existed (polled every 5 ms); None if the child ended first or time ran
        out. A manifest is written last, by rename: once it exists, that training checkpoint is committed."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if not self.proc.is_alive() or time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return time.monotonic() - self.t0

    def kill(self) -> int | None:
        """SIGKILL at once; the exit code (-9 when the kill ended it, 0 when it had finished already)."""
        if self.proc.exitcode is None:  # never a signal to a pid that has ended (and may be reused)
            self.proc.kill()
        self.proc.join(timeout=30)
        return self.proc.exitcode

    def finish(self, timeout: float = 300) -> dict | None:
        """The child's TrainReport; None when it failed or did not end within `timeout` s (then it is killed)."""
        self.proc.join(timeout=timeout)
        if self.proc.is_alive():
            self.kill()
            return None
        if self.proc.exitcode != 0 or not self.report_path.exists():
            return None
        return json.loads(self.report_path.read_text())


def complete_steps(root: Path) -> list[int]:
    """Steps of the committed (manifest present) training checkpoints in a local checkpoint.uri folder."""
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/manifest.json"))


def state_differences(a, b, path: str = "") -> list[str]:
    """Where two nested states (dicts, lists, tensors, numbers) differ; tensors by dtype, shape and raw bytes
    (bitwise: -0.0 == 0.0 and NaN != NaN would blur it). Empty when they are identical."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
        return [] if same else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys differ ({sorted(map(str, a.keys() ^ b.keys()))[:4]})"]
        return [d for k in a for d in state_differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in state_differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def training_checkpoint_differences(a: Path, b: Path, ignore: tuple[str, ...] = ("mlflow_run_id",)) -> list[str]:
    """Where two training checkpoint folders differ, each read as a resume reads it (SafeTensors, weights_only
    loads, JSON): every weight, the whole optimizer state, the RNG states and state.json but `ignore`."""
    from memfit.checkpoints.reader import read_checkpoint_folder

    x, y = read_checkpoint_folder(a), read_checkpoint_folder(b)
    sx, sy = ({k: v for k, v in s.state.items() if k not in ignore} for s in (x, y))
    return (state_differences(dict(x.model_state), dict(y.model_state), "model")
            + state_differences(x.optimizer_state, y.optimizer_state, "optimizer")
            + state_differences(x.rng_tensors, y.rng_tensors, "rng") + state_differences(sx, sy, "state"))
