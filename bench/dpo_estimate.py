"""A DPO step's planned peak against the real one, per reference mode (precompute, adapter_off, copy), on CPU.

    python bench/dpo_estimate.py                    # the rows of docs/preference.md -> docs/dpo_estimate.json
    python bench/dpo_estimate.py --small --out /tmp/x   # one tiny row (the suite runs this)

Each row is a random-weight Llama of the given shape training one DPO step of `pairs` pairs (chosen + rejected: 2
rows each) through memfit's own DpoObjective with its reference, fp32: the real peak is memfit's tracker over that
step (real tensors; the reference's forward included), the estimate is the estimator's for the same stack and
block kinds (`Estimator(dpo=..., dpo_logits_keep=...)`: the trace the planner ranks). The first `prompt` tokens of
every row are a prompt, so the head runs from the first predicting position in both.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memfit.config import LoraConfig  # noqa: E402
from memfit.config.devices import PROFILES  # noqa: E402
from memfit.files import write_json_atomic  # noqa: E402
from memfit.memory.estimator.compose import Stack  # noqa: E402
from memfit.memory.estimator.estimate import Estimator  # noqa: E402
from memfit.memory.estimator.step import init_optimizer_state, make_optimizer, run_step  # noqa: E402
from memfit.memory.estimator.tracker import StepTracker  # noqa: E402
from memfit.memory.techniques.policies import apply_policy, find_blocks, make_policy  # noqa: E402
from memfit.models.lora import prepare_lora_model  # noqa: E402
from memfit.training.objective import AdapterOff, DpoObjective, FrozenCopy, Precomputed  # noqa: E402

MB = 1e6
# (label, vocab, width, blocks, pairs, seq, prompt, kind): wide vocabularies, where the logits are the step.
SHAPES = [("2 blocks, width 256, vocab 128256, 2 pairs x 512, prompt 256", 128256, 256, 2, 2, 512, 256, "none"),
          ("6 blocks, width 256, vocab 32000, 2 pairs x 256, prompt 64", 32000, 256, 6, 2, 256, 64, "none"),
          ("6 blocks, width 256, vocab 32000, 2 pairs x 256, prompt 64, every block recomputed", 32000, 256, 6, 2,
           256, 64, "full")]
SMALL = [("2 blocks, width 64, vocab 4096, 2 pairs x 64, prompt 32", 4096, 64, 2, 2, 64, 32, "none")]
MODES = (("precompute", True), ("adapter_off", True), ("copy", False), ("precompute", False))


def llama(vocab: int, width: int, blocks: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=blocks,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)


class Pairs:
    """run_step's {"input_ids", "labels"} of 2 x pairs rows as a preference batch: chosen first, rejected after."""

    def __init__(self, objective: DpoObjective, prompt: int) -> None:
        self.objective, self.prompt = objective, prompt

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        labels = ids.clone()
        labels[:, :self.prompt] = -100
        n = ids.shape[0] // 2
        return self.objective(model, {"input_ids": ids[:n], "labels": labels[:n], "rejected_input_ids": ids[n:],
                                      "rejected_labels": labels[n:], "ref_chosen_logps": torch.zeros(n),
                                      "ref_rejected_logps": torch.zeros(n)})


def measured(config: LlamaConfig, mode: str, lora: bool, pairs: int, seq: int, prompt: int, kind: str) -> int:
    """The tracker's peak over one real DPO step (the optimizer state already allocated, as in every later step)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    if lora:
        model = prepare_lora_model(model, LoraConfig(enabled=True, r=8), "fp32")
    apply_policy(model, make_policy(kind))
    reference = {"copy": lambda: FrozenCopy(model), "precompute": Precomputed,
                 "adapter_off": lambda: AdapterOff(model)}[mode]()
    optimizer = make_optimizer(model)
    init_optimizer_state(optimizer)
    tracker = StepTracker(find_blocks(model))
    tracker.track_external(model, optimizer, *([reference.model] if mode == "copy" else []))
    ids = torch.randint(0, config.vocab_size, (2 * pairs, seq), generator=torch.Generator().manual_seed(5))
    with tracker:
        run_step(model, optimizer, [ids], "fp32", tracker, loss_fn=Pairs(DpoObjective(reference=reference), prompt))
    return tracker.result().peak_bytes


def row(shape: tuple, mode: str, lora: bool) -> dict[str, Any]:
    label, vocab, width, blocks, pairs, seq, prompt, kind = shape
    config = llama(vocab, width, blocks)
    est = Estimator(copy.deepcopy(config), seq, PROFILES["cpu"], dpo=SimpleNamespace(reference=mode,
                                                                                      loss_type="sigmoid"),
                    dpo_logits_keep=seq - prompt + 1 if prompt else None,
                    lora_cfg=LoraConfig(enabled=True, r=8) if lora else None)
    t0 = time.perf_counter()
    estimate = est.estimate(Stack("fp32", pairs, 1, lora), [kind] * blocks)
    traced = time.perf_counter() - t0
    real = measured(config, mode, lora, pairs, seq, prompt, kind)
    return {"model": label, "reference": mode, "lora": lora, "estimate_bytes": estimate.peak_bytes,
            "real_bytes": real, "ratio": round(estimate.peak_bytes / real, 4), "peak_at": estimate.peak_at,
            "trace_s": round(traced, 2)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | reference | LoRA | estimate MB | real MB | estimate / real | where the plan peaks |",
             "|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['reference']} | {'yes' if r['lora'] else 'no'} | {r['estimate_bytes'] / MB:.1f} "
              f"| {r['real_bytes'] / MB:.1f} | {r['ratio']:.3f} | {r['peak_at']} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="one tiny shape (seconds): a smoke run")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for dpo_estimate.json")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row(shape, mode, lora) for shape in (SMALL if args.small else SHAPES) for mode, lora in MODES]
    print(markdown(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": "cpu", "precision": "fp32"}
    target = args.out / "dpo_estimate.json"
    write_json_atomic(target, {**meta, "rows": rows}, indent=1)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
