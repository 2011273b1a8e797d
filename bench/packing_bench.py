"""Packing modes on the same conversations: blocks vs padding_free vs none, tokens/s and trained tokens/s side by side.

    PYTHONPATH=. python bench/packing_bench.py [--conversations 600 --seq-len 256 --hidden 256 --layers 4 --steps 6]

Each mode packs the same generated conversations (loss on the assistant turns) with data.seq_len rows and trains
through the real Trainer (the loop's batch dicts: labels, position_ids and the block-diagonal mask, or the attention
mask cut to the batch's longest row). Blocks of steps alternate between modes (A B C A B C ...) and medians are
reported, as step-time ratios need. Columns:
  tokens/s          real (non-padding) tokens a second that the step consumes
  trained tokens/s  tokens whose prediction is trained a second (what a chat fine-tune learns from)
  conv/s            conversations a second (an epoch's speed)
`blocks` trains as many tokens, but lets conversations attend to each other (and cuts them at block boundaries).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODES = ("blocks", "padding_free", "none")


def _config(args: argparse.Namespace, data: Path, work: Path, packing: str):
    from memfit import config

    return config.load(REPO / "configs" / "chat.yaml", [
        f"run.work_dir={work}", f"checkpoint.uri={work / 'ck'}", f"export.dir={work / 'export'}",
        f"data.path={data}", f"data.packing={packing}", f"data.seq_len={args.seq_len}", "data.val_fraction=0.05",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=4",
        f"model.max_position_embeddings={max(512, args.seq_len)}", f"train.batch_size={args.batch}",
        "train.grad_accum_steps=1", f"train.num_threads={args.threads}", f"train.device={args.device}",
        "tracking.backend=null"])


def _real_tokens(bundle) -> object:
    """Non-padding tokens per training row."""
    import torch

    f, ids = bundle.train_fields, bundle.train
    if "attention_mask" in f:
        return f["attention_mask"].sum(-1)
    if "position_ids" in f:  # the tail padding is the last segment, all untrained pad tokens
        real = []
        for pos, lab in zip(f["position_ids"], f["labels"], strict=True):
            start = int((pos == 0).nonzero()[-1])
            real.append(start if bool((lab[start:] == -100).all()) and start > 0 else len(pos))
        return torch.tensor(real)
    return torch.full((len(ids),), ids.shape[1])


def _setup(args, data: Path, work: Path, packing: str):
    from memfit import run_context
    from memfit.data.prepare import prepare_data
    from memfit.reports import PlanReport
    from memfit.runtime.env import pin_threads, resolve_device
    from memfit.tracking.null import NullTracker
    from memfit.training.loop import Trainer

    cfg = _config(args, data, work, packing)
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = run_context.load_inputs(cfg)
    bundle = prepare_data(cfg, inputs.tokenizer, inputs.texts.corpus())
    plan = PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=args.batch, grad_accum_steps=1,
                      reason="bench", description="none")
    model = run_context.build_training_model(cfg, inputs.model, plan)
    tracker = NullTracker()
    tracker.start_run("bench")
    trainer = Trainer(cfg, plan, model, bundle, device, tracker, None, run_context.run_identity(cfg))
    taken: list[int] = []
    draw = trainer.order.next_indices
    trainer.order.next_indices = lambda: taken.extend(draw()) or taken[-args.batch:]  # record what each step reads
    return trainer, bundle, taken, _real_tokens(bundle), device


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=3, help="blocks per mode (interleaved)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    from memfit.data.synthetic import synthetic_conversations, write_jsonl

    with tempfile.TemporaryDirectory(prefix="memfit-packing-bench-") as tmp:
        root = Path(tmp)
        data = write_jsonl([{"messages": m} for m in synthetic_conversations(args.conversations, 7, max_turns=4)],
                           root / "conversations.jsonl")
        runs = {m: _setup(args, data, root / m, m) for m in MODES}
        for trainer, *_ in runs.values():  # warm-up: first-step allocations and kernel selection
            trainer.optimizer_step()
        times = {m: [] for m in MODES}
        counts = {m: {"real": 0, "trained": 0, "conv": 0.0, "steps": 0} for m in MODES}
        for _ in range(args.rounds):
            for mode, (trainer, bundle, taken, real, device) in runs.items():
                start_trained, start_taken = trainer.trained_tokens_seen, len(taken)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    trainer.optimizer_step()
                _sync(device)
                times[mode].append((time.perf_counter() - t0) / args.steps)
                rows = taken[start_taken:]
                c = counts[mode]
                c["real"] += int(real[rows].sum())
                c["trained"] += trainer.trained_tokens_seen - start_trained
                c["conv"] += len(rows) * bundle.stats["examples"] / (len(bundle.train) + len(bundle.val))
                c["steps"] += args.steps
        print(f"\n{args.conversations} conversations, rows of {args.seq_len} tokens, batch {args.batch}, "
              f"{args.hidden}x{args.layers} Llama on {args.device}; median of {args.rounds} blocks of {args.steps} "
              "steps\n")
        print("| packing | rows | trained share | s/step | tokens/s | trained tokens/s | conv/s | trained tok/s vs "
              "none |")
        print("|---|---|---|---|---|---|---|---|")
        per_s = {}
        for mode in MODES:
            c, step = counts[mode], statistics.median(times[mode])
            per_step = {k: c[k] / c["steps"] for k in ("real", "trained", "conv")}
            per_s[mode] = {k: v / step for k, v in per_step.items()}
        for mode in MODES:
            bundle = runs[mode][1]
            s = per_s[mode]
            print(f"| {mode} | {len(bundle.train)} | {bundle.trained_share():.1%} | "
                  f"{statistics.median(times[mode]):.4f} | {s['real']:,.0f} | {s['trained']:,.0f} | "
                  f"{s['conv']:,.1f} | {s['trained'] / per_s['none']['trained']:.2f}x |")


if __name__ == "__main__":
    main()
