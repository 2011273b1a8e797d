"""Padded rows with their mask against without it (right padding: the causal mask alone), on CPU: peak and step time.

    python bench/padding_mask.py                     # the rows of docs/preference.md -> docs/padding_mask.json
    python bench/padding_mask.py --small --out /tmp/x   # one tiny shape (the suite runs this)

Each shape is a random-weight Llama training on right-padded rows as memfit lays them out (one example, or one
pair's side, a row; the batch cut to its longest row): an SFT step (plain loss) and a DPO step (DpoObjective, the
reference precomputed) each run once with the 2-D padding mask passed to the model, as memfit did before
2026-12-07, and once without, as blocks_batch now does. The peak is memfit's tracker over one step (real tensors),
the time the median of rounds of steps, the modes interleaved by round. The summed log-probs (DPO) and the loss
(SFT) of the two are compared too: without the mask they are the same numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memfit.data.packing import pack_padded  # noqa: E402
from memfit.files import write_json_atomic  # noqa: E402
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, train_step  # noqa: E402
from memfit.memory.estimator.tracker import StepTracker  # noqa: E402
from memfit.memory.techniques.loss import PlainLoss, blocks_batch  # noqa: E402
from memfit.memory.techniques.policies import find_blocks  # noqa: E402
from memfit.training.objective import DpoObjective, Precomputed, policy_logps  # noqa: E402

MB = 1e6
# (label, vocab, width, blocks, rows, shortest, longest): rows of lengths spread evenly between the two.
SHAPES = [("4 blocks, width 256, vocab 8000, 8 rows of 256-1024 tokens", 8000, 256, 4, 8, 256, 1024),
          ("4 blocks, width 256, vocab 8000, 8 rows of 512-2048 tokens", 8000, 256, 4, 8, 512, 2048)]
SMALL = [("2 blocks, width 64, vocab 4096, 4 rows of 16-64 tokens", 4096, 64, 2, 4, 16, 64)]


def rows(vocab: int, n: int, shortest: int, longest: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Right-padded rows; the second half of each trained (a completion); as pairs, row i's rejected side is row
    n-1-i (so each pair's sides differ in length)."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.linspace(shortest, longest, n).round().long().tolist()
    encoded = []
    for length in lengths:
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        encoded.append((ids, [-100] * (length // 2) + ids[length // 2:]))
    packed, _ = pack_padded(encoded, longest, pad_id=0)
    fields = {k: v for k, v in packed.items() if k != "input_ids"}
    return packed["input_ids"], fields


def batch_of(ids: torch.Tensor, fields: dict[str, torch.Tensor], objective: str, masked: bool) -> dict[str, Any]:
    if objective == "dpo":
        half = ids.shape[0] // 2
        sides = {"labels": fields["labels"][:half], "attention_mask": fields["attention_mask"][:half],
                 "rejected_input_ids": ids[half:].flip(0), "rejected_labels": fields["labels"][half:].flip(0),
                 "rejected_attention_mask": fields["attention_mask"][half:].flip(0),
                 "ref_chosen_logps": torch.zeros(half), "ref_rejected_logps": torch.zeros(half)}
        return blocks_batch(ids[:half], slice(None), None, sides, padding_mask=masked)
    return blocks_batch(ids, slice(None), None, fields, padding_mask=masked)


def step(model, optimizer, batch, loss_fn, tracker: StepTracker | None = None) -> None:
    train_step(model, iter([batch]), "fp32", loss_fn, 1, tracker=tracker)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(shape: tuple, objective: str, rounds: int) -> dict[str, Any]:
    label, vocab, width, blocks, n, shortest, longest = shape
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=blocks,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    ids, fields = rows(vocab, n, shortest, longest)
    loss_fn = DpoObjective(reference=Precomputed()) if objective == "dpo" else PlainLoss()
    batches = {m: batch_of(ids, fields, objective, m) for m in (True, False)}
    with torch.no_grad():  # the numbers each computes: the DPO log-probs, the SFT loss
        same = [policy_logps(model, batches[m])[0] if objective == "dpo" else PlainLoss()(model, batches[m])
                for m in (True, False)]
    out: dict[str, Any] = {"model": label, "objective": objective, "rows": n if objective == "sft" else n // 2,
                           "max_abs_diff": float((same[0] - same[1]).abs().max())}
    for masked in (True, False):
        tracker = StepTracker(find_blocks(model))
        tracker.track_external(model, optimizer)
        with tracker:
            step(model, optimizer, batches[masked], loss_fn, tracker)
        out["masked_peak" if masked else "causal_peak"] = tracker.result().peak_bytes
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):  # interleaved by round: a slower stretch of the machine hits both modes
        for masked in (True, False):
            t0 = time.perf_counter()
            step(model, optimizer, batches[masked], loss_fn)
            times[masked].append(time.perf_counter() - t0)
    out["masked_s"], out["causal_s"] = statistics.median(times[True]), statistics.median(times[False])
    out["peak_ratio"] = round(out["causal_peak"] / out["masked_peak"], 4)
    out["time_ratio"] = round(out["causal_s"] / out["masked_s"], 4)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| model | objective | peak with mask MB | without MB | ratio | step with mask s | without s | ratio "
             "| max abs diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['objective']} | {r['masked_peak'] / MB:.1f} | {r['causal_peak'] / MB:.1f} | "
              f"{r['peak_ratio']:.3f} | {r['masked_s']:.3f} | {r['causal_s']:.3f} | {r['time_ratio']:.3f} | "
              f"{r['max_abs_diff']:.1e} |" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="one tiny shape (seconds): a smoke run")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for padding_mask.json")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(shape, objective, 1 if args.small else args.rounds)
               for shape in (SMALL if args.small else SHAPES) for objective in ("sft", "dpo")]
    print(markdown(results))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": "cpu", "precision": "fp32",
            "threads": torch.get_num_threads()}
    target = args.out / "padding_mask.json"
    write_json_atomic(target, {**meta, "rows": results}, indent=1)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
