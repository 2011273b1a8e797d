"""What memfit's training loop costs beside a bare PyTorch loop and the HF Trainer, and where its time goes.

    PYTHONPATH=. python bench/loop_overhead.py [--rounds 3] [--steps 100] [--block 10] [--optimizer fused]

Three loops train the same tiny model (configs/tiny.yaml's preset and data), seed, AdamW (torch.optim.AdamW
over memfit's two parameter groups, betas 0.9/0.95, fused or foreach: --optimizer), schedule, clipping and
2 torch threads, in two variants: `none` (no tracking, no training checkpoints) and `full` (MLflow on a SQLite
store under a temporary folder, a training checkpoint every 10 steps to a local folder). memfit is
memfit.training.loop.Trainer with its memory monitor as configured by default; bare is the loop a person
writes (mlflow.log_metrics(synchronous=False) per step, torch.save every 10 steps); HF is transformers.Trainer
(report_to mlflow, save_steps 10). In a round, the loops of one variant run as concurrent processes that take
turns: a token passed over pipes lets one process train a block of --block steps while the others wait on a
pipe read, so the blocks of one turn see the same machine state (other people's jobs included). --warmup
steps (whole blocks) are untimed, then --steps timed. Ratios are per block pair (the same turn), reported as
the median over all rounds' pairs with the quartiles and the range. Prints a table (also
bench/out/loop_overhead.md), keeps every block in bench/out/loop_overhead_rounds.json and, with --plot, a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from loop_report import OUT, THREADS, print_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOOPS = ("bare", "memfit", "hf")
VARIANTS = ("none", "full")
SAVE_EVERY = 10


# -- one process: one loop, one variant ------------------------------------------------------------------
class Turns:
    """This process's side of the turn-taking: a stamp after every optimizer step; after every `block` steps
    the token goes back to the driver and the process waits (a blocking pipe read, no CPU) for its next turn."""

    def __init__(self, ctl: str, block: int) -> None:
        rfd, wfd = (int(x) for x in ctl.split(","))
        self._go, self._done, self.block = os.fdopen(rfd, "rb", 0), os.fdopen(wfd, "wb", 0), block
        self.stamps: list[float] = []
        self.cpu: list[float] = []  # process CPU time at the same moments (all its threads)
        self.resumed: list[tuple[float, float]] = []  # (wall, CPU) when each turn began
        self.paused_cpu = 0.0  # CPU the process spent while it waited (its background threads)

    def wait(self) -> None:
        t = time.process_time()
        self._done.write(b"d")
        if self._go.read(1) != b"g":
            raise SystemExit("loop_overhead worker: the driver went away")
        self.resumed.append((time.perf_counter(), time.process_time()))
        if len(self.resumed) > 1:
            self.paused_cpu += self.resumed[-1][1] - t

    def mark(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if len(self.stamps) % self.block == 0:
            self.wait()


def _config(root: Path, variant: str, steps: int):
    from memfit import config

    run = root / f"run-{time.monotonic_ns()}"
    return config.load(REPO / "configs" / "tiny.yaml", [
        f"run.work_dir={root / 'work'}", f"checkpoint.uri={run / 'checkpoints'}", f"export.dir={run / 'export'}",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}", "tracking.experiment=loop-overhead",
        f"tracking.backend={'mlflow' if variant == 'full' else 'null'}", "tracking.system_metrics=false",
        f"train.max_steps={steps}", f"train.num_threads={THREADS}",
        f"checkpoint.every_steps={SAVE_EVERY if variant == 'full' else 10**6}"])


def _adamw(model, cfg, fused: bool):
    import torch

    from memfit.memory.techniques.optim import ADAMW_BETAS, param_groups

    return torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=ADAMW_BETAS,
                             fused=fused or None)


def _inputs(cfg):
    import torch

    from memfit.data.cache import cached_data
    from memfit.run_context import load_inputs

    torch.set_num_threads(THREADS)
    inputs = load_inputs(cfg)
    return inputs.model, cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)


def _metrics(loss: float, lr: float, norm: float, tokens: int, dt: float) -> dict[str, float]:
    import psutil

    rss = psutil.Process().memory_info().rss  # what memfit logs on CPU each step
    return {"loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt, "step_time_s": dt,
            "memory_peak_bytes": rss, "memory_current_bytes": rss}


def run_bare(cfg, variant: str, fused: bool, turns: Turns) -> dict:
    import mlflow
    import torch

    from memfit.data.order import BatchOrder
    from memfit.memory.techniques.optim import make_scheduler
    from memfit.memory.techniques.schedule import seed_everything

    model, data = _inputs(cfg)
    t = cfg.train
    seed_everything(t.seed)
    opt = _adamw(model, cfg, fused)
    sched = make_scheduler(opt, t)
    order = BatchOrder(len(data.train), t.micro_batch_size, t.seed)
    full = variant == "full"
    if full:
        mlflow.set_tracking_uri(cfg.tracking.uri)
        mlflow.set_experiment(cfg.tracking.experiment)
        mlflow.start_run(run_name="bare")
    ckpt = Path(cfg.checkpoint.uri)
    ckpt.mkdir(parents=True, exist_ok=True)
    tokens = t.batch_size * data.train.shape[1]
    model.train()
    turns.wait()
    for step in range(1, t.max_steps + 1):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(t.grad_accum_steps):
            ids = data.train[order.next_indices()]
            loss = model(input_ids=ids, labels=ids).loss / t.grad_accum_steps
            loss.backward()
            total += float(loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if full:
            mlflow.log_metrics(_metrics(total, sched.get_last_lr()[0], float(norm), tokens,
                                        time.perf_counter() - t0), step=step, synchronous=False)
            if step % SAVE_EVERY == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step}, ckpt / "last.pt.tmp")
                os.replace(ckpt / "last.pt.tmp", ckpt / "last.pt")
        turns.mark()
    if full:
        mlflow.end_run()
    return {}


def run_hf(cfg, variant: str, fused: bool, turns: Turns) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memfit.memory.techniques.optim import make_scheduler

    model, data = _inputs(cfg)
    t = cfg.train
    full = variant == "full"
    if full:
        os.environ.update(MLFLOW_TRACKING_URI=cfg.tracking.uri, MLFLOW_EXPERIMENT_NAME=cfg.tracking.experiment)

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            turns.mark()

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(data.train)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": data.train[i], "labels": data.train[i]}

    opt = _adamw(model, cfg, fused)
    args = TrainingArguments(
        output_dir=str(Path(cfg.checkpoint.uri)), per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum_steps, max_steps=t.max_steps, max_grad_norm=t.max_grad_norm,
        logging_steps=1, save_strategy="steps" if full else "no", save_steps=SAVE_EVERY, save_total_limit=2,
        report_to=["mlflow"] if full else [], seed=t.seed, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, run_name="hf")
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), optimizers=(opt, make_scheduler(opt, t)),
                      callbacks=[Stamp()])
    turns.wait()
    trainer.train()
    return {}


def run_memfit(cfg, variant: str, fused: bool, turns: Turns) -> dict:
    """memfit's Trainer, with timers around the parts of its loop (the breakdown); the loop itself as shipped."""
    try:  # as `memfit run` does: MLflow in its own process, started before torch imports
        from memfit.tracking.process import prestart

        prestart(cfg.tracking)
        own_process = {"prestarted": True}
    except ImportError:  # a `--before` tree from before the tracking process
        own_process = {}
    import torch

    from memfit.memory.estimator.timeline import LiveBytes
    from memfit.memory.planner.monitor import MemoryMonitor
    from memfit.run_context import checkpoint_manager, run_identity
    from memfit.tracking import make_tracker
    from memfit.training import loop, strategies

    model, data = _inputs(cfg)
    strategies.optim.make_adamw = lambda m, lr, wd, **_: _adamw(m, cfg, fused)  # the bench's AdamW, in every loop
    spent = {"step": [], "monitor": 0.0, "save": 0.0, "flush": 0.0}
    counted: list[int] = []
    saved_at: list[int] = []

    class Timed(loop.Trainer):
        def optimizer_step(self):
            t0 = time.perf_counter()
            out = super().optimizer_step()
            spent["step"].append(time.perf_counter() - t0)
            turns.mark()  # its turn may end here: the rest of the step (monitor, save) opens the next turn
            return out

        def save(self, blocking, force=False, deadline=None, busy=None):
            t0 = time.perf_counter()
            super().save(blocking, force, deadline, busy)
            if not blocking:
                spent["save"] += time.perf_counter() - t0
                saved_at.append(self.step)

    def timer(fn, key):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapped

    MemoryMonitor._record = timer(MemoryMonitor._record, "monitor")
    enter = LiveBytes.__enter__

    def counting(self):  # a step run under the monitor's dispatch mode (live tensor bytes counted)
        counted.append(len(spent["step"]) + 1)
        return enter(self)
    LiveBytes.__enter__ = counting
    tracker = make_tracker(cfg.tracking, **own_process)
    tracker.flush = timer(tracker.flush, "flush")
    tracker.start_run("memfit")
    manager = checkpoint_manager(cfg)
    try:  # the plan, an object of its own since the plan/config split (a `--before` tree from before takes none)
        from memfit.run_context import configured_plan

        planned = (configured_plan(cfg, "none", reason="bench"),)
    except ImportError:
        planned = ()
    trainer = Timed(cfg, *planned, model, data, torch.device("cpu"), tracker, manager, run_identity(cfg))
    try:
        turns.wait()
        trainer.fit()
    finally:
        manager.close()
        tracker.end_run()
    return {"step_s": spent["step"], "monitor_read_s": spent["monitor"],
            "save_call_s": spent["save"], "flush_s": spent["flush"], "counted": counted, "saved_at": saved_at,
            "log_caller_s": getattr(tracker, "caller_seconds", 0.0),
            "snapshot_s": manager.stats.total_snapshot_s, "stall_s": manager.stats.total_stall_s}


def worker(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    loop_name, variant = args.worker.split(":")
    cfg = _config(Path(args.root), variant, args.warmup + args.steps)
    turns = Turns(args.ctl, args.block)
    run = {"bare": run_bare, "memfit": run_memfit, "before": run_memfit, "hf": run_hf}[loop_name]
    out = run(cfg, variant, args.optimizer == "fused", turns)
    b, first = args.block, args.warmup // args.block  # the timed turns: after the warm-up ones
    ends = [(turns.stamps[(k + 1) * b - 1], turns.cpu[(k + 1) * b - 1]) for k in range(len(turns.resumed) - 1)]
    spans = list(zip(turns.resumed[:-1], ends, strict=True))[first:]
    out["blocks"] = [(end[0] - start[0]) / b for start, end in spans]  # seconds per step, turn by turn
    out["blocks_cpu"] = [(end[1] - start[1]) / b for start, end in spans]
    out["steps"] = b * len(spans)
    out["seconds"] = sum(out["blocks"]) * b
    # CPU over the whole timed span, the waits included: what background threads did while others ran counts.
    out["cpu_seconds"] = spans[-1][1][1] - spans[0][0][1]
    out["paused_cpu_s"] = turns.paused_cpu
    Path(args.json).write_text(json.dumps(out))


def run_group(args: argparse.Namespace, modes: list[str], tmp: str, env: dict, steps: int, warmup: int,
              rotate: int) -> dict[str, dict]:
    """The loops of `modes` as concurrent processes taking turns of --block steps; their outputs by mode."""
    procs = {}
    for mode in modes:
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        tree = args.before if mode.startswith("before:") else REPO
        cmd = [sys.executable, __file__, "--worker", mode, "--root", tmp, "--json", f"{tmp}/{mode}.json",
               "--steps", str(steps), "--warmup", str(warmup), "--optimizer", args.optimizer,
               "--block", str(args.block), "--ctl", f"{go_r},{done_w}"]
        proc = subprocess.Popen(cmd, env={**env, "PYTHONPATH": str(tree)}, cwd=tmp, pass_fds=(go_r, done_w))
        os.close(go_r)
        os.close(done_w)
        procs[mode] = (proc, os.fdopen(go_w, "wb", 0), os.fdopen(done_r, "rb", 0))

    def turn_done(mode: str) -> None:
        if procs[mode][2].read(1) != b"d":
            raise SystemExit(f"loop_overhead: the {mode} worker failed (exit {procs[mode][0].wait()})")

    try:
        for mode in modes:  # set-up (imports, model, data) overlaps, untimed; then one turn at a time
            turn_done(mode)
        for k in range((steps + warmup) // args.block):
            j = (k + rotate) % len(modes)  # who goes first rotates from turn to turn
            for mode in modes[j:] + modes[:j]:
                procs[mode][1].write(b"g")
                turn_done(mode)
        for mode in modes:  # the last turn's end: everyone finishes (final save, exit) at once, untimed
            procs[mode][1].write(b"g")
        for mode in modes:
            if procs[mode][0].wait() != 0:
                raise SystemExit(f"loop_overhead: the {mode} worker failed (exit {procs[mode][0].returncode})")
    finally:
        for proc, *_ in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {mode: json.loads(Path(f"{tmp}/{mode}.json").read_text()) for mode in modes}


# -- the driver: rounds of process groups taking turns, the table ------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="fresh process groups per variant")
    p.add_argument("--steps", type=int, default=100, help="timed steps per process (whole blocks)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first, per process (whole blocks)")
    p.add_argument("--block", type=int, default=SAVE_EVERY, help="steps per turn (a multiple of the save interval "
                   "keeps one save in every turn)")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated, from bare,memfit,hf")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from none,full")
    p.add_argument("--before", type=Path, default=None,
                   help="another memfit tree (e.g. `git worktree add` of main): its loop runs as `before`, "
                   "taking turns with this one")
    p.add_argument("--plot", type=Path, default=None, help="write a bar chart PNG here")
    for hidden in ("--worker", "--root", "--json", "--ctl"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    whole = lambda n: max(args.block, -(-n // args.block) * args.block)  # noqa: E731 - whole blocks, at least one
    args.steps, args.warmup = whole(args.steps), whole(args.warmup)
    if args.worker:
        return worker(args)
    loops = args.loops.split(",") + (["before"] if args.before else [])
    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {f"{lp}:{v}": [] for v in variants for lp in loops}
    env = {**os.environ, "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(THREADS)}
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="memfit-loop-bench-") as tmp:
        # Preset build, MLflow store, first imports: not timed. One loop at a time: two processes creating the
        # same SQLite store at once race in its schema migration (seen with --before).
        setup = "full" if "full" in variants else variants[-1]  # full creates the store
        for lp in loops:
            run_group(args, [f"{lp}:{setup}"], tmp, env, args.block, args.block, 0)
        for rnd in range(args.rounds):
            for v in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                modes = [f"{lp}:{v}" for lp in loops]
                for mode, out in run_group(args, modes, tmp, env, args.steps, args.warmup, rnd).items():
                    results[mode].append(out)
                OUT.mkdir(exist_ok=True)  # kept group by group: a long run that fails late still leaves its turns
                (OUT / "loop_overhead_rounds.json").write_text(json.dumps(results))
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{m} {1000 * statistics.median(r[-1]['blocks']):.1f} ms "
                f"(CPU {1000 * r[-1]['cpu_seconds'] / r[-1]['steps']:.1f})" for m, r in results.items()), flush=True)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print_table(args, loops, variants, results)


if __name__ == "__main__":
    main()
