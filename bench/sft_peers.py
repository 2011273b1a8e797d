"""memfit vs TRL's SFTTrainer vs the HF Trainer on one SFT job: trained tokens/s and peak RSS as ratios to TRL.

    pip install trl==1.16.0   # bench-only; not a memfit dependency
    PYTHONPATH=. python bench/sft_peers.py [--steps 8 --rounds 2 --conversations 120]

The job: a Llama of SmolLM2-135M's shape (576 wide, 30 layers, 9 heads / 3 kv heads, vocab 49152) with random
weights built locally from LlamaConfig, a byte-level BPE trained here on the conversations (memfit's preset
tokenizer and chat template), generated chat data, loss on the assistant turns only, micro-batch --batch, rows of
--seq-len tokens, fp32, AdamW (0.9, 0.95, eps 1e-8, weight decay 0.01), warmup then cosine to 0, clip 1.0, the
same threads. Every peer gets the same encoded examples (memfit's encoder: token ids and the assistant mask):
  memfit  data.packing auto through memfit's own data path and Trainer step (the loop's optimizer_step)
  trl     SFTTrainer, packing (bfd) + padding_free, assistant-only loss from the pre-tokenized mask
  hf      Trainer, one example a row padded per batch (DataCollatorForSeq2Seq), labels -100 off the answers
Each run is its own process (peak RSS is that process's ru_maxrss); peers alternate within a round. Trained
tokens/s = tokens with a loss label the steps consumed / the wall time of the optimizer steps, first step's start
to last step's end (HF/TRL: a TrainerCallback; memfit: around its loop's optimizer_step calls). Everyone trains in
fp32 without gradient checkpointing (TRL 1.16's SFTConfig defaults to bf16 and gradient checkpointing: both set off)
with the same AdamW (--optim). Validation loss: every peer's model on the same held-out conversations, each alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PEERS = ("trl", "hf", "memfit")  # with --compile, memfit-compile too (train.compile)
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048, "rope_theta": 100000.0,
         "tie_word_embeddings": True}
LR, WARMUP, WD = 3e-4, 2, 0.01


def prepare(work: Path, args: argparse.Namespace) -> None:
    """Conversations, tokenizer, random model and the encoded examples every peer trains on."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit import config
    from memfit.data.formats import load_texts
    from memfit.data.masking import encode_examples
    from memfit.data.synthetic import synthetic_conversations, write_jsonl
    from memfit.models.loading import SPECIAL_TOKEN, train_tokenizer

    convs = synthetic_conversations(args.conversations, 7, max_turns=4)
    n_val = max(4, len(convs) // 10)
    write_jsonl([{"messages": m} for m in convs[:-n_val]], work / "train.jsonl")
    write_jsonl([{"messages": m} for m in convs[-n_val:]], work / "val.jsonl")
    texts = [t["content"] for m in convs for t in m]
    tok = train_tokenizer(texts, args.tokenizer_vocab, work / "model")
    special = tok.convert_tokens_to_ids(SPECIAL_TOKEN)
    shape = {**SHAPE, "vocab_size": args.vocab or SHAPE["vocab_size"],
             "num_hidden_layers": args.layers or SHAPE["num_hidden_layers"]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape, bos_token_id=special, eos_token_id=special,
                                                         pad_token_id=special))
    model.save_pretrained(str(work / "model"))
    for split in ("train", "val"):
        cfg = config.load(None, [f"data.path={work / f'{split}.jsonl'}", "data.format=messages",
                                 "data.train_on=assistant", f"data.seq_len={args.seq_len}"])
        encoded = encode_examples(load_texts(cfg.data), tok, cfg.data)
        rows = [(ids[:args.seq_len], lab[:args.seq_len]) for ids, lab in encoded]
        (work / f"{split}.encoded.json").write_text(json.dumps(rows))


def _trained(labels) -> int:
    return int((labels[..., 1:] != -100).sum())


def val_loss(model, work: Path) -> float:
    """Mean loss per trained token over the held-out conversations, each alone (no packing, no padding)."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for ids, labels in json.loads((work / "val.encoded.json").read_text()):
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            n = _trained(torch.tensor(labels))
            total, count = total + float(out.loss) * n, count + n
    return total / max(1, count)


def _hf_args(args: argparse.Namespace, out: Path, **extra):
    common = dict(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
                  learning_rate=LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                  lr_scheduler_type="cosine", warmup_steps=WARMUP, max_grad_norm=1.0, logging_steps=10_000,
                  save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=1234,
                  disable_tqdm=True, optim="adamw_torch_fused" if args.optim == "fused" else "adamw_torch",
                  # The same job for everyone: TRL 1.16's SFTConfig defaults to bf16 and gradient checkpointing.
                  bf16=False, fp16=False, gradient_checkpointing=False)
    return {**common, **extra}


def _step_clock():
    """A TrainerCallback timing the optimizer steps alone (first step's start to last step's end), as memfit's
    side is timed: set-up, dataloader creation and the end-of-training hooks are outside for every peer."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        start: float | None = None
        end: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

    return StepClock()


def _counting(model) -> list[int]:
    seen = [0]

    def hook(_module, _args, kwargs):  # trained tokens of every batch the trainer feeds the model
        if model.training and kwargs.get("labels") is not None:
            seen[0] += _trained(kwargs["labels"])
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def run_peer(peer: str, work: Path, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    train = json.loads((work / "train.encoded.json").read_text())
    if peer.startswith("memfit"):
        return _run_memfit(work, args, compiled=peer == "memfit-compile")
    from datasets import Dataset

    model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.float32)
    seen = _counting(model)
    if peer == "trl":
        from trl import SFTConfig, SFTTrainer

        ds = Dataset.from_list([{"input_ids": ids, "assistant_masks": [int(t != -100) for t in lab]}
                                for ids, lab in train])
        cfg = SFTConfig(**_hf_args(args, work / "out-trl", packing=True, packing_strategy="bfd", padding_free=True,
                                   max_length=args.seq_len, dataset_num_proc=None))  # assistant_masks always apply
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds)
    else:
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        from memfit.models.loading import load_tokenizer

        tok = load_tokenizer(str(work / "model"))
        ds = Dataset.from_list([{"input_ids": ids, "labels": lab, "attention_mask": [1] * len(ids)}
                                for ids, lab in train])
        trainer = Trainer(model=model, args=TrainingArguments(**_hf_args(args, work / "out-hf")), train_dataset=ds,
                          data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100))
    clock = _step_clock()
    trainer.add_callback(clock)
    trainer.train()
    return {"trained": seen[0], "seconds": clock.end - clock.start, "val_loss": val_loss(model, work)}


def _run_memfit(work: Path, args: argparse.Namespace, compiled: bool = False) -> dict:
    from memfit import config, run_context
    from memfit.data.cache import cached_data
    from memfit.runtime.env import pin_threads, resolve_device
    from memfit.tracking.null import NullTracker
    from memfit.training.loop import Trainer

    cfg = config.load(None, [
        f"run.work_dir={work / 'out-memfit'}", f"checkpoint.uri={work / 'out-memfit' / 'ck'}",
        f"model.name_or_path={work / 'model'}", "model.preset=null", f"data.path={work / 'train.jsonl'}",
        "data.format=messages", "data.train_on=assistant", "data.packing=auto", f"data.seq_len={args.seq_len}",
        "data.val_fraction=0.01", f"train.batch_size={args.batch}", "train.grad_accum_steps=1",
        f"train.max_steps={args.steps}", f"train.lr={LR}", f"train.warmup_steps={WARMUP}", "train.min_lr_ratio=0",
        f"train.weight_decay={WD}", "train.max_grad_norm=1.0", f"train.num_threads={args.threads}",
        "train.device=cpu", "train.seed=1234", "tracking.backend=null", f"train.compile={compiled}",
        f"memory.optimizer={'adamw-fused' if args.optim == 'fused' else 'adamw'}"])
    device = resolve_device(cfg.train.device)
    pin_threads(cfg.train.num_threads)
    inputs = run_context.load_inputs(cfg)
    data = cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer, inputs.model.config)
    plan = run_context.configured_plan(cfg, "none", reason="bench")  # memory.optimizer as the --optim asked
    model = run_context.build_training_model(cfg, inputs.model, plan)
    tracker = NullTracker()
    tracker.start_run("bench")
    trainer = Trainer(cfg, plan, model, data, device, tracker, None, run_context.run_identity(cfg))
    model.train()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.optimizer_step()
    seconds = time.perf_counter() - t0
    trainer.compile_clock.close()
    # train.compile: the compile time (torch.compile's own callbacks) is reported apart, not in the step rate.
    compile_s = trainer.compile_clock.total
    return {"trained": trainer.trained_tokens_seen, "seconds": seconds - compile_s, "val_loss": val_loss(model, work),
            "packing": data.packing, "compile_s": compile_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokenizer-vocab", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=0, help="model vocabulary (0: SmolLM2's 49152)")
    p.add_argument("--layers", type=int, default=0, help="decoder blocks (0: SmolLM2's 30)")
    p.add_argument("--work", default=str(REPO / "runs" / "sft_peers"))
    p.add_argument("--out", default=str(REPO / "docs" / "sft_peers"))
    p.add_argument("--optim", choices=("fused", "plain"), default="fused",
                   help="AdamW for every peer: torch's fused kernel (the HF Trainer's default) or the plain loop")
    p.add_argument("--compile", action="store_true", help="also memfit with train.compile (compile time apart)")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args()
    work = Path(args.work)
    if args.peer:  # a child: one run, its figures as one JSON line
        result = run_peer(args.peer, work, args)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print("RESULT " + json.dumps(result), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, args)
    peers = (*PEERS, "memfit-compile") if args.compile else PEERS
    results: dict[str, list[dict]] = {peer: [] for peer in peers}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for r in range(args.rounds):
        order = peers if r % 2 == 0 else tuple(reversed(peers))  # alternate who runs first (warm caches, load)
        for peer in order:
            cmd = [sys.executable, __file__, "--peer", peer, *sys.argv[1:]]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{peer} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(line[7:])
            results[peer].append(res)
            print(f"round {r + 1} {peer}: {res['trained'] / res['seconds']:.1f} trained tok/s, "
                  f"{res['peak_rss_bytes'] / 2**30:.2f} GiB, val {res['val_loss']:.4f}", flush=True)
    report(results, args)


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    rate = {p: [r["trained"] / r["seconds"] for r in rs] for p, rs in results.items()}
    rss = {p: statistics.median(r["peak_rss_bytes"] for r in rs) for p, rs in results.items()}
    val = {p: statistics.median(r["val_loss"] for r in rs) for p, rs in results.items()}
    med = {p: statistics.median(v) for p, v in rate.items()}
    lines = [f"{args.steps} steps, micro-batch {args.batch}, seq {args.seq_len}, {args.threads} threads, "
             f"{args.rounds} rounds; memfit packing: {results['memfit'][0].get('packing')}", "",
             "| peer | trained tokens/s (median) | x TRL (min-max over rounds) | peak RSS GiB | x TRL | val loss |",
             "|---|---|---|---|---|---|"]
    peers = tuple(results)
    for p in peers:
        lo, hi = min(rate[p]) / med["trl"], max(rate[p]) / med["trl"]
        lines.append(f"| {p} | {med[p]:,.1f} | {med[p] / med['trl']:.2f} ({lo:.2f}-{hi:.2f}) | "
                     f"{rss[p] / 2**30:.2f} | {rss[p] / rss['trl']:.2f} | {val[p]:.4f} |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(peers, [med[p] / med["trl"] for p in peers])
    axes[0].set_title("trained tokens/s (x TRL)")
    axes[1].bar(peers, [rss[p] / rss["trl"] for p in peers])
    axes[1].set_title("peak RSS (x TRL)")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    main()
