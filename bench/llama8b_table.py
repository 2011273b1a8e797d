"""The Llama-3-8B shape from the estimator (LoRA, QLoRA, full fine-tune) beside the anchors' published figures.

Workload (issue #14, torchtune's recipes): configs/llama-3-8b-lora.yaml at batch 2 x 2048, LoRA r=8 on every
linear layer of the blocks, full gradient checkpointing (or offload, its CUDA variant), target an RTX 4090.
Nothing is allocated: each row is `memfit estimate` on fake tensors from config.json alone, with the loss
(memory.loss), the lean layers (memory.lean_layers) and the AdamW variant (memory.optimizer,
memory.optimizer_in_backward) named in its label.

    PYTHONPATH=. python bench/llama8b_table.py            # a few minutes on 2 busy cores; writes bench/out/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memfit import config  # noqa: E402
from memfit.memory.planner.search import estimate_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
# The shape's folder by its full path: the config names it relative to the repository, the bench may run elsewhere.
WORKLOAD = [f"model.name_or_path={REPO / 'configs' / 'models' / 'llama-3-8b'}", "train.batch_size=2",
            "train.grad_accum_steps=1", "data.seq_len=2048", "lora.r=8", "lora.alpha=16"]
# (label, --set overrides, policy, the anchor's published figure for the same job)
CHUNKED = ["memory.loss=chunked"]
LEAN = [*CHUNKED, "memory.lean_layers=true"]  # the chunked loss and the lean SwiGLU / RMSNorm layers
LEANEST = ["lora.enabled=false", "train.precision=bf16-true", "train.max_grad_norm=null",
           "memory.optimizer=adamw-cpu-offload", "memory.optimizer_in_backward=true", *LEAN]
TORCHTUNE_LORA = "torchtune 16.2 GiB (RTX 4090, Llama-3.1-8B, batch 2, packed 2048)"
NO_CLIP = ["train.max_grad_norm=null", "memory.optimizer_in_backward=true"]
ROWS = [
    ("LoRA, bf16-mixed, bf16 frozen base, plain loss", ["lora.enabled=true", "memory.loss=plain"], "full", ""),
    ("LoRA, bf16 base, chunked loss", ["lora.enabled=true", *CHUNKED], "full", ""),
    ("LoRA, bf16 base, chunked loss, lean layers", ["lora.enabled=true", *LEAN], "full", TORCHTUNE_LORA),
    ("LoRA, bf16 base, chunked loss, activation offload", ["lora.enabled=true", *CHUNKED], "offload", ""),
    ("LoRA, bf16 base, chunked loss, lean layers, activation offload", ["lora.enabled=true", *LEAN], "offload",
     TORCHTUNE_LORA),
    ("LoRA, bf16 base, chunked, lean, offload, AdamW step in backward (no clipping)",
     ["lora.enabled=true", *LEAN, *NO_CLIP], "offload", TORCHTUNE_LORA),
    ("LoRA, bf16 base, chunked loss, lean layers, 8-bit AdamW",
     ["lora.enabled=true", *LEAN, "memory.optimizer=adamw-8bit"], "full", ""),
    ("LoRA, bf16-true, chunked loss, lean layers", ["lora.enabled=true", "train.precision=bf16-true", *LEAN],
     "full", ""),
    ("QLoRA (NF4 base), bf16-mixed, plain loss", ["lora.enabled=true", "lora.quantize=nf4", "memory.loss=plain"],
     "full", ""),
    ("QLoRA (NF4 base), chunked loss", ["lora.enabled=true", "lora.quantize=nf4", *CHUNKED], "full", ""),
    ("QLoRA (NF4 base), chunked loss, lean layers", ["lora.enabled=true", "lora.quantize=nf4", *LEAN], "full",
     "torchtune 7.4 GiB"),
    ("QLoRA (NF4 base), chunked loss, lean layers, activation offload",
     ["lora.enabled=true", "lora.quantize=nf4", *LEAN], "offload",
     "torchtune 7.4 GiB; Unsloth: 40.7 K tokens of context on 16 GB"),
    ("QLoRA (NF4 base), chunked loss, lean layers, 8-bit AdamW",
     ["lora.enabled=true", "lora.quantize=nf4", *LEAN, "memory.optimizer=adamw-8bit"], "full", "torchtune 7.4 GiB"),
    ("full fine-tune, bf16-true, AdamW", ["lora.enabled=false", "train.precision=bf16-true", "memory.loss=plain",
                                          "memory.optimizer=adamw"], "full", ""),
    ("full fine-tune, bf16-true, chunked, lean, AdamW on the CPU, step in backward", LEANEST, "full",
     "torchtune 18.9 GiB (paged 8-bit AdamW, optimizer step in backward)"),
]


def row(label: str, sets: list[str], policy: str, anchor: str, device: str) -> dict:
    cfg = config.load(REPO / "configs" / "llama-3-8b-lora.yaml", WORKLOAD + sets)
    t0 = time.perf_counter()
    out = estimate_report(cfg, device=device, policy=policy)
    b = out["breakdown"]
    return {"stack": label, "policy": policy, "total_gib": out["total_bytes"] / GIB,
            "weights_gib": out["weight_bytes"] / GIB, "params_gib": b["params"] / GIB,
            "optimizer_gib": b["optimizer"] / GIB, "activations_gib": b["activations"] / GIB,
            "other_gib": b["other"] / GIB, "loss": cfg.memory.loss, "optimizer": cfg.memory.optimizer,
            "host_gib": out["host_bytes"] / GIB, "peak_at": out["peak_at"],
            "fits": out["fits"], "anchor": anchor, "seconds": round(time.perf_counter() - t0, 1)}


def markdown(rows: list[dict], device: str) -> str:
    head = (f"| stack ({device}, batch 2 x 2048, LoRA r=8) | checkpointing | memfit estimate GiB | params | "
            "optimizer | activations | other | host | peak at | published figure |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['stack']} | {r['policy']} | **{r['total_gib']:.2f}** | {r['params_gib']:.2f} | "
            f"{r['optimizer_gib']:.2f} | {r['activations_gib']:.2f} | {r['other_gib']:.2f} | {r['host_gib']:.2f} | "
            f"{r['peak_at'].replace('micro-batch 1, ', '')} | {r['anchor']} |" for r in rows]
    return "\n".join([head, *body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="rtx-4090", help="target device profile (a CUDA one allows offload)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    rows = []
    for label, sets, policy, anchor in ROWS:
        rows.append(row(label, sets, policy, anchor, args.device))
        print(f"{label}: {rows[-1]['total_gib']:.2f} GiB ({rows[-1]['seconds']} s)", file=sys.stderr, flush=True)
    table = markdown(rows, args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama8b_table.md").write_text(table + "\n")
    (out / "llama8b_table.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
