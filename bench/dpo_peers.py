"""memfit's DPO step beside TRL's DPOTrainer on the same model, pairs and batch (CPU): time and peak tensor memory.

    pip install trl==1.16.0   # in the dev extra
    PYTHONPATH=. python bench/dpo_peers.py [--layers 6 --pairs 4 --rounds 5]

Both compute the loss of one batch of preference pairs with a frozen reference copy and back-propagate it, on the
same inputs (TRL's collator output, laid out as memfit's chosen/rejected batch, as tests/unit/test_dpo_oracle.py
does): the DPO-specific part of a step. The optimizer step is the same AdamW for both and is left out. Peak tensor
memory is what memfit's StepTracker (a dispatch-level allocation tracker) sees during the forward and backward,
weights excluded, in a second, tracked pass (the time is of the bare pass); the rounds alternate who goes first.
Losses are printed beside, to show it is the same job.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def build(args: argparse.Namespace):
    from chat_support import bpe_tokenizer
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.data.synthetic import synthetic_conversations

    # Chat-length pairs: a conversation's first user turn, its answer (chosen) and the answer's words reversed.
    pairs = []
    for conv in synthetic_conversations(64, 3, max_turns=args.turns):
        answer = " ".join(t["content"] for t in conv[1:])
        pairs.append({"prompt": conv[0]["content"], "chosen": " " + answer,
                      "rejected": " " + " ".join(reversed(answer.split()))})
    tok = bpe_tokenizer([p["prompt"] + p["chosen"] + p["rejected"] for p in pairs], vocab_size=args.vocab)
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                 num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                 max_position_embeddings=1024, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    policy = LlamaForCausalLM(LlamaConfig(**shape)).float()
    return tok, Dataset.from_list(pairs), policy


def trl_step(trainer, inputs):
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach()


def memfit_step(objective, model, batch):
    loss = objective(model, batch)
    loss.backward()
    return loss.detach()


def memfit_batch(inputs: dict) -> dict:
    ids, attn, comp = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    labels = ids.masked_fill(comp == 0, -100)
    n = ids.shape[0] // 2
    return {"input_ids": ids[:n], "attention_mask": attn[:n], "labels": labels[:n], "rejected_input_ids": ids[n:],
            "rejected_attention_mask": attn[n:], "rejected_labels": labels[n:]}


def measure(model, fn, *a) -> tuple[float, int, float]:
    """(seconds, peak tensor bytes, loss) of one forward + backward: timed bare, then again under the tracker for
    the peak (its per-op bookkeeping would distort the time)."""
    from memfit.memory.estimator.tracker import StepTracker, total

    start = time.perf_counter()
    loss = fn(*a)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)  # both passes start without gradients
    tracker = StepTracker()
    with tracker:
        fn(*a)
    model.zero_grad(set_to_none=True)
    return seconds, total(tracker.peak_vec), float(loss)


def main() -> None:
    import trl

    from memfit.training.objective import DpoObjective, FrozenCopy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--turns", type=int, default=6, help="turns of the generated conversations (answer length)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "docs" / "dpo_peers"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok, data, policy = build(args)
    scratch = tempfile.TemporaryDirectory(prefix="dpo-peers-")  # TRL's output_dir: the bench saves nothing there
    cfg = trl.DPOConfig(output_dir=scratch.name, loss_type=["sigmoid"], beta=0.1, bf16=False, use_cpu=True,
                        gradient_checkpointing=False, report_to=[], per_device_train_batch_size=args.pairs,
                        max_length=None)
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(policy), args=cfg,
                             train_dataset=data, processing_class=tok)
    trainer.model.train()
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(args.pairs)])
    ours = copy.deepcopy(policy).train()
    objective = DpoObjective(beta=0.1, loss_type="sigmoid", reference=FrozenCopy(policy))
    batch = memfit_batch(inputs)
    runs = {"trl": lambda: measure(trainer.model, trl_step, trainer, inputs),
            "memfit": lambda: measure(ours, memfit_step, objective, ours, batch)}
    for fn in runs.values():  # warm-up: first-call allocations and lazy inits out of the figures
        fn()
    results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for name in (runs if r % 2 == 0 else reversed(list(runs))):
            results[name].append(runs[name]())
    # The fastest round as well as the median: on a shared machine the median carries the others' load, the
    # minimum is the least disturbed pass of each.
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), v[0][2], min(x[0] for x in v))
           for k, v in results.items()}
    width = inputs["input_ids"].shape[1]
    lines = [f"DPO sigmoid, frozen reference copy; Llama {args.layers} x {args.hidden}, vocab {len(tok)}; "
             f"{args.pairs} pairs padded to {width} tokens; {args.threads} threads; medians of {args.rounds} rounds",
             "", "| | forward + backward s, median | x TRL | fastest round s | x TRL | peak tensor MB | x TRL | loss |",
             "|---|---|---|---|---|---|---|---|"]
    for k, (sec, peak, loss, fastest) in med.items():
        lines.append(f"| {k} | {sec:.3f} | {sec / med['trl'][0]:.2f} | {fastest:.3f} | {fastest / med['trl'][3]:.2f} | "
                     f"{peak / 1e6:.1f} | {peak / med['trl'][1]:.2f} | {loss:.6f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"table": table, "rounds": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
