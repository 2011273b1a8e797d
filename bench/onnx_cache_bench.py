"""Seconds and CPU seconds of a full ONNX export vs one from the ONNX graph cache, side by side in one process.

    PYTHONPATH=. python bench/onnx_cache_bench.py [--config configs/tiny.yaml] [--rounds 2]

The model is the preset of the config's `model` section with random weights (a new seed per export, so every
cached export puts different weights into the graph). Rounds alternate full / cached so that machine load
hits both alike; a full export gets an empty MEMFIT_CACHE_DIR, a cached one the folder the first full export
filled. Both are `memfit.release.formats.export_onnx` end to end: export or cache, save, onnx.checker, parity.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(config_path: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.config import load
    from memfit.models.loading import preset_config

    m = load(config_path).model
    spec = {"preset": m.preset, "hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
            "max_positions": m.max_position_embeddings}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(preset_config(spec, m.vocab_size, 0)).eval()


def timed_export(model, out: Path, cache_dir: Path) -> dict:
    from memfit.release.formats import export_onnx

    os.environ["MEMFIT_CACHE_DIR"] = str(cache_dir)
    wall, cpu = time.perf_counter(), time.process_time()
    res = export_onnx(model, out)
    return {"source": res.graph_source, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "max_abs_diff": res.max_abs_diff, "load1": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows, load_start = [], os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="memfit-onnx-cache-") as tmp:
        tmp = Path(tmp)
        shared = tmp / "shared-cache"
        seed = 0
        for r in range(args.rounds):
            for kind in ("full", "cached"):
                seed += 1
                cache = shared if kind == "cached" or r == 0 else tmp / f"empty-{r}"
                row = timed_export(build(args.config, seed), tmp / f"{kind}-{r}.onnx", cache)
                if row["source"] != ("export" if kind == "full" else "cache"):
                    raise SystemExit(f"round {r} {kind}: the export came from {row['source']!r}")
                rows.append({"round": r, "kind": kind, **row})
    print(f"model: {args.config} (preset, random weights); load average (1, 5, 15 min) at start "
          f"{' '.join(f'{x:.2f}' for x in load_start)}, at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'round':>5} {'export':>7} {'seconds':>8} {'CPU s':>7} {'max|diff|':>10} {'load1':>6}")
    for r in rows:
        print(f"{r['round']:>5} {r['kind']:>7} {r['wall_s']:>8.2f} {r['cpu_s']:>7.2f} {r['max_abs_diff']:>10.2g} "
              f"{r['load1']:>6.2f}")
    full = [r for r in rows if r["kind"] == "full"]
    cached = [r for r in rows if r["kind"] == "cached"]
    for what in ("wall_s", "cpu_s"):
        f, c = statistics.median(r[what] for r in full), statistics.median(r[what] for r in cached)
        print(f"median {what}: full {f:.2f}, cached {c:.2f}, ratio {f / c:.1f}x")


if __name__ == "__main__":
    main()
