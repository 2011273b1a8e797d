"""ONNX parity figures of fp32 rounding vs a perturbed graph, on Llama models up to 135 M parameters.

    PYTHONPATH=. python bench/onnx_parity.py [--models tiny,20m,103m,135m] [--json out.jsonl]

Random init, with the final norm scaled so that max |logit| reaches a pretrained model's (~20):
tiny random models have |logits| < 1 and never show the rounding a real checkpoint does. For each
model: the figures memfit.release.parity computes (max |diff|, relative to max |logit|, top-1 agreement, max
KL per position) for the plain export, then for the same graph with one weight initializer (the
middle MLP down projection) perturbed by Gaussian noise of 0.1%, 1% and 10% of its std.
These figures chose the defaults of ExportConfig.onnx_rtol / onnx_min_top1 / onnx_max_kl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
MODELS = {
    "tiny": (64, 2, 4, 4, 256, 384, False),  # the tiny-llama preset of configs/tiny.yaml
    "20m": (384, 8, 6, 6, 1024, 8192, False),
    "103m": (768, 12, 12, 12, 2048, 12000, False),
    "135m": (576, 30, 9, 3, 1536, 49152, True),  # SmolLM-135M's shape: the model of issue 12
}
SHAPES = ((1, 8), (2, 16), (3, 5), (2, 64))
NOISE = (1e-3, 1e-2, 1e-1)


def build(name: str, target_logit: float = 20.0):
    """A seeded random Llama of MODELS[name], its logits scaled to max |logit| ~ target_logit."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab, tied = MODELS[name]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    scale_logits(model, target_logit)
    return model


def scale_logits(model, target: float) -> float:
    """Scale the final RMSNorm weight so max |logit| on a probe batch is `target`; logits are linear in it."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        now = float(model(input_ids=ids, use_cache=False).logits.abs().max())
        model.model.norm.weight.mul_(target / now)
    return target / now


def perturb_initializer(src: Path, dst: Path, rel_std: float, seed: int = 0) -> str:
    """Copy ONNX `src` to `dst` with Gaussian noise (rel_std x the weight's std) on one weight matrix,
    the middle one of the 2-D initializers shaped like an MLP down projection; returns its name.

    The dynamo exporter folds the transposes of linear weights into anonymous `val_N` initializers,
    so the matrix is found by its shape (intermediate x hidden), not by its PyTorch name.
    """
    import numpy as np
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(src))
    mats = [t for t in proto.graph.initializer if len(t.dims) == 2 and t.dims[0] > t.dims[1]
            and "embed" not in t.name]
    if not mats:
        raise SystemExit(f"no weight matrix initializer in {src}")
    init = mats[len(mats) // 2]
    w = numpy_helper.to_array(init)
    noise = np.random.default_rng(seed).standard_normal(w.shape).astype(w.dtype) * (rel_std * w.std())
    init.CopyFrom(numpy_helper.from_array(w + noise, init.name))
    onnx.save(proto, str(dst))
    return init.name


def figures(path: Path, model, shapes=SHAPES):
    import onnxruntime as ort
    import torch

    from memfit.release.formats import sample_ids
    from memfit.release.parity import shape_parity

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = []
    for i, (b, s) in enumerate(shapes):
        ids = sample_ids(model.config.vocab_size, b, s, seed=1000 + i)
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits.float().numpy()
        out.append(shape_parity(ref, session.run(["logits"], {"input_ids": ids.numpy()})[0]))
    return out


def measure(name: str, work: Path) -> list[dict]:
    import torch

    from memfit.release.formats import LogitsOnly

    model = build(name)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    path = work / f"{name}.onnx"
    program = torch.onnx.export(LogitsOnly(model).eval(), (torch.zeros(2, 16, dtype=torch.long),), dynamo=True,
                                input_names=["input_ids"], output_names=["logits"], verbose=False,
                                dynamic_shapes={"input_ids": {0: "batch", 1: "sequence"}})
    program.save(path)
    export_s = time.perf_counter() - t0
    rows = []
    for noise in (0.0, *NOISE):
        target = path
        if noise:
            target = work / f"{name}-noise.onnx"
            perturb_initializer(path, target, noise)
        for p in figures(target, model):
            rows.append({"model": name, "params_m": round(n_params / 1e6, 1), "perturbation": noise,
                         "export_s": round(export_s, 1), **p.to_dict()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", help="Also append the rows as JSON lines here.")
    args = ap.parse_args()
    print(f"{'model':>6} {'params':>7} {'perturb':>7} {'shape':>6} {'max|diff|':>10} {'max|logit|':>10} "
          f"{'relative':>9} {'top-1':>7} {'max KL':>9}")
    with tempfile.TemporaryDirectory(prefix="memfit-parity-") as tmp:
        for name in args.models.split(","):
            rows = measure(name, Path(tmp))
            for r in rows:
                print(f"{r['model']:>6} {r['params_m']:>6}M {r['perturbation']:>7g} {r['batch']}x{r['seq']:<4} "
                      f"{r['max_abs_diff']:>10.3g} {r['max_abs_logit']:>10.3g} {r['relative']:>9.2g} "
                      f"{r['top1_agree']:>3}/{r['positions']:<3} {r['max_kl']:>9.2g}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
