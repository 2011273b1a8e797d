"""Training checkpoints to S3 (a local moto server): snapshot time, training stall per save, upload MB/s, restart time.

    PYTHONPATH=. python bench/checkpoint_bench.py [--hidden 512 --layers 6 --blocks 3 --steps 12 --every 4]

Target (issue 4): training stall per save <= 1.5x the in-memory snapshot time, i.e. the write, hash and
upload happen off the training thread. The stall is measured two ways, side by side in one run:
  in-thread  time the training thread spends in the save call (wait for the previous save + snapshot + hand-off);
  wall       extra wall time of a block of steps with saves over the same block without, per save
             (so it also counts what the writer thread takes from training: CPU, memory bandwidth, the GIL).
Blocks with and without saves alternate (A B A B ...) and medians are reported, as step-time ratios need.
Restart-to-first-resumed-step is a fresh process: imports, recover (list, download, sha256), restore, one step.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _config(args: argparse.Namespace, uri: str, work: Path):
    from memfit import config

    return config.load(REPO / "configs" / "tiny.yaml", [
        f"run.work_dir={work}", f"checkpoint.uri={uri}", f"export.dir={work / 'export'}",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=8",
        f"model.vocab_size={args.vocab}", "data.synthetic_docs=600", f"train.max_steps={10_000}",
        "train.batch_size=8", "train.grad_accum_steps=1", "train.warmup_steps=2", f"train.num_threads={args.threads}",
        "tracking.backend=null", f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=2",
        "checkpoint.on_busy=wait",
    ])


def _trainer(cfg, manager):
    from memfit import run_context
    from memfit.data.prepare import prepare_data
    from memfit.reports import PlanReport
    from memfit.runtime.env import pin_threads, resolve_device
    from memfit.tracking.null import NullTracker
    from memfit.training.loop import Trainer

    device = resolve_device("cpu")
    pin_threads(cfg.train.num_threads)
    inputs = run_context.load_inputs(cfg)
    data = prepare_data(cfg, inputs.tokenizer, inputs.texts.corpus())
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=8, grad_accum_steps=1,
                      reason="bench", description="none")
    model = run_context.build_training_model(cfg, inputs.model, plan)
    tracker = NullTracker()
    tracker.start_run("bench")
    return Trainer(cfg, plan, model, data, device, tracker, manager, run_context.run_identity(cfg))


def _block(trainer, steps: int, every: int | None) -> float:
    """Wall seconds for `steps` optimizer steps, saving (in the background) every `every` steps.

    Saves fall mid-interval (steps every/2, every/2 + every, ...) so each upload overlaps training; the
    block's time includes waiting for the last upload to end, so what did not overlap counts as stall.
    """
    trainer.checkpoints.wait()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        trainer.model.train()
        trainer.optimizer_step()
        if every and i % every == every // 2:
            trainer.save(blocking=False)
    trainer.checkpoints.wait()
    return time.perf_counter() - t0


def child_resume(args: argparse.Namespace) -> None:
    """Run in a fresh process: time from process start to the first resumed optimizer step."""
    t_start = float(args.spawned_at)
    from memfit import phases, run_context

    t_import = time.time()
    cfg = _config(args, args.uri, Path(args.work))
    resume = phases.recover_training_checkpoint(cfg)
    t_recover = time.time()
    trainer = _trainer(cfg, run_context.checkpoint_manager(cfg))
    trainer.restore(Path(resume.local_dir))
    t_restore = time.time()
    trainer.model.train()
    trainer.optimizer_step()
    t_step = time.time()
    trainer.checkpoints.close()
    print(json.dumps({"imports_s": t_import - t_start, "recover_s": t_recover - t_import,
                      "build_restore_s": t_restore - t_recover, "first_step_s": t_step - t_restore,
                      "total_s": t_step - t_start, "resumed_step": resume.step}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the writer thread needs a core too)")
    p.add_argument("--blocks", type=int, default=3, help="pairs of blocks (without saves, with saves)")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per block")
    p.add_argument("--every", type=int, default=8, help="save every N steps in the blocks with saves")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    p.add_argument("--child-resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", help=argparse.SUPPRESS)
    args = p.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1", "DO_NOT_TRACK": "true",
                 "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    if args.child_resume:
        child_resume(args)
        return

    import logging
    import socket

    import boto3

    from memfit.checkpoints import CheckpointManager
    from memfit.storage import LocalStore
    from memfit.storage.s3 import S3Store

    logging.basicConfig(level=logging.WARNING)
    # moto in its own process, as S3 would be: in a thread here it would fight training for the GIL.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(server.terminate)  # also when the bench fails half-way: no moto server left behind
    os.environ["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            boto3.client("s3").create_bucket(Bucket="bench")
            break
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.1)
    uri = "s3://bench/run"
    work = Path(tempfile.mkdtemp(prefix="memfit-ckpt-bench-"))
    cfg = _config(args, uri, work)
    manager = CheckpointManager(S3Store(uri), keep_last=2, staging_dir=work / "staging", on_busy="wait")
    trainer = _trainer(cfg, manager)
    n_params = sum(p.numel() for p in trainer.model.parameters())

    _block(trainer, 3, None)  # warm-up (allocator, first-step costs)
    snap_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        trainer.strategy.snapshot(trainer)  # what every save takes on the training thread
        snap_times.append(time.perf_counter() - t0)
    # The same saves to a local folder: memfit's own cost, without an S3 server on these same cores.
    local = CheckpointManager(LocalStore(work / "local-ckpt"), keep_last=2, staging_dir=work / "staging")
    plain, saving, saving_local = [], [], []
    for _ in range(args.blocks):
        plain.append(_block(trainer, args.steps, None))
        saving.append(_block(trainer, args.steps, args.every))
        trainer.checkpoints = local
        saving_local.append(_block(trainer, args.steps, args.every))
        trainer.checkpoints = manager
    local.close()
    manager.wait()
    records = manager.completed()
    saves_per_block = args.steps // args.every
    snapshot_s = statistics.median(snap_times)
    step_s = statistics.median(plain) / args.steps
    wall_stall = (statistics.median(saving) - statistics.median(plain)) / saves_per_block
    wall_stall_local = (statistics.median(saving_local) - statistics.median(plain)) / saves_per_block
    thread_stall = statistics.median(r.stall_s for r in records)
    ckpt_mb = statistics.median(r.bytes for r in records) / 1e6
    save_mb_s = statistics.median(r.upload_mb_per_s for r in records)
    save_s = statistics.median(r.write_upload_s for r in records)

    # Raw upload throughput of one checkpoint-sized file (multipart above 64 MiB), no serialisation or hashing.
    blob = work / "blob.bin"
    blob.write_bytes(os.urandom(int(ckpt_mb * 1e6)))
    store = S3Store("s3://bench/raw")
    ups = []
    for i in range(3):
        t0 = time.perf_counter()
        store.put_file(blob, f"blob-{i}")
        ups.append(blob.stat().st_size / 1e6 / (time.perf_counter() - t0))
    raw_mb_s = statistics.median(ups)
    manager.close()

    child = subprocess.run([sys.executable, __file__, "--child-resume", "--uri", uri, "--work", str(work),
                            "--spawned-at", repr(time.time()), "--hidden", str(args.hidden), "--layers",
                            str(args.layers), "--vocab", str(args.vocab), "--threads", str(args.threads),
                            "--every", str(args.every)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    if child.returncode != 0:
        server.terminate()
        sys.exit(f"resume child failed:\n{child.stderr[-3000:]}")
    restart = json.loads(child.stdout.strip().splitlines()[-1])
    server.terminate()
    server.wait(timeout=30)

    rows = [
        ("model parameters", f"{n_params / 1e6:.1f} M"),
        ("training checkpoint size (weights + AdamW + RNG + state)", f"{ckpt_mb:.1f} MB"),
        ("torch threads / cores", f"{args.threads} / {os.cpu_count()}"),
        ("optimizer step (median, no saves)", f"{step_s * 1e3:.0f} ms"),
        ("in-memory snapshot (median)", f"{snapshot_s * 1e3:.1f} ms"),
        ("training stall per save, in-thread (median)", f"{thread_stall * 1e3:.1f} ms"),
        ("training stall per save, wall (blocks with - without saves)", f"{wall_stall * 1e3:.1f} ms"),
        ("stall / snapshot, in-thread (target <= 1.5)", f"{thread_stall / snapshot_s:.2f}"),
        ("stall / snapshot, wall (target <= 1.5)", f"{wall_stall / snapshot_s:.2f}"),
        ("training stall per save, wall, to a local folder instead", f"{wall_stall_local * 1e3:.1f} ms"),
        ("stall / snapshot, wall, local folder", f"{wall_stall_local / snapshot_s:.2f}"),
        ("background save: write + sha256 + upload + manifest (median)", f"{save_s:.2f} s"),
        ("  end-to-end save throughput", f"{save_mb_s:.0f} MB/s"),
        ("raw S3 upload throughput to local moto", f"{raw_mb_s:.0f} MB/s"),
        ("restart to first resumed step (fresh process)", f"{restart['total_s']:.1f} s"),
        ("  imports", f"{restart['imports_s']:.1f} s"),
        ("  recover: list + download + verify", f"{restart['recover_s']:.2f} s"),
        ("  build model + data, restore", f"{restart['build_restore_s']:.1f} s"),
        ("  first resumed step", f"{restart['first_step_s']:.2f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\ncheckpoint benchmark: {args.blocks} x ({args.steps} steps plain, {args.steps} steps saving "
          f"every {args.every}) to moto S3 at 127.0.0.1\n")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>10}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"snapshot_s": snapshot_s, "stall_in_thread_s": thread_stall, "stall_wall_s": wall_stall,
              "stall_wall_local_s": wall_stall_local,
              "step_s": step_s, "save_s": save_s, "save_mb_s": save_mb_s, "raw_upload_mb_s": raw_mb_s,
              "checkpoint_mb": ckpt_mb, "restart": restart, "params": n_params, "threads": args.threads}
    (args.out / "checkpoint_bench.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "checkpoint_bench.png")
    print(f"\nwrote {args.out / 'checkpoint_bench.png'} and checkpoint_bench.json")


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["snapshot", "stall:\nthread", "stall:\nwall, S3", "stall:\nwall, local", "target\n1.5x snap"]
    vals = [r["snapshot_s"] * 1e3, r["stall_in_thread_s"] * 1e3, r["stall_wall_s"] * 1e3,
            r["stall_wall_local_s"] * 1e3, r["snapshot_s"] * 1.5e3]
    a.bar(names, vals, color=["#4c72b0", "#55a868", "#8172b2", "#64b5cd", "#cccccc"])
    a.set_ylabel("ms per save")
    a.set_title(f"training stall per save ({r['checkpoint_mb']:.0f} MB checkpoint)")
    b.bar(["save end-to-end", "raw upload"], [r["save_mb_s"], r["raw_upload_mb_s"]], color=["#dd8452", "#c44e52"])
    b.set_ylabel("MB/s")
    b.set_title("throughput to local S3 (moto)")
    parts = ["imports_s", "recover_s", "build_restore_s", "first_step_s"]
    bottom = 0.0
    for part in parts:
        c.bar(["restart"], [r["restart"][part]], bottom=bottom, label=part.removesuffix("_s"))
        bottom += r["restart"][part]
    c.set_ylabel("s")
    c.set_title("restart to first resumed step")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
