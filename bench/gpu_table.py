"""The GPU table: memfit's estimate vs the allocator's real peak, memfit vs a hand-written loop and TRL's SFTTrainer.

    python3 bench/gpu_table.py run --out DIR [--doc docs/gpu.md] [--deadline-s 250]   # on the GPU (gpu_kit.sh run)
    python3 bench/gpu_table.py run --out DIR --dry-run                                  # tiny shapes on the CPU

Random-weight Llama shapes are made on the device from configs/models/llama-3-8b/config.json (the 1B row:
Llama-3.2-1B's widths) with a small tokenizer memfit trains; every row runs in a fresh process (bench/gpu_rows.py,
where the rows are), so the truth, torch.cuda.max_memory_allocated over that whole process, is read outside
memfit. memfit rows: `memfit profile` (real optimizer steps through the Trainer `memfit run` uses); estimates:
`memfit estimate --device <gpu> --json`, run beside the GPU rows (they use the CPU). MFU: PaLM's FLOPs per token
over the device's dense bf16 peak. After the table: the issue's goals as ratios, and where the time of the default,
DPO and DPO-twin steps goes. Rows past the deadline are listed as not run; the table is written whatever happened.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_rows import (
    DEFAULT,
    DPO_ROW,
    DPO_TWIN,
    DRY_JOB,
    DRY_SHAPES,
    JOB,
    LOOP,
    REPO,
    ROWS,
    SHAPES,
    TRACED,
    TRL,
    TWIN,
    sets,
    twin_sets,
)

ROWS_SCRIPT = str(Path(__file__).with_name("gpu_rows.py"))


# -- the driver ----------------------------------------------------------------------------------------------
def _spawn(args: list[str], background: bool = False) -> subprocess.Popen:
    """A child process; `background` ones (the estimates, which overlap the timed rows) run at the lowest priority
    on one thread, so a row's step time is not the estimates' contention: in the dry run on 2 cores the first
    row's step took 10x the next one's while five estimates ran beside it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p)}
    nice: list[str] = []
    if background:
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    return subprocess.Popen([*nice, sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _collect(proc: subprocess.Popen, timeout: float, log: Path) -> dict:
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out = (out or "") + "\nROW " + json.dumps({"error": f"timed out after {timeout:.0f} s"})
    with log.open("a") as f:
        f.write(out or "")
    # A child's ROW line, else `memfit estimate --json`'s one JSON line. Other lines may start with "{" too: TRL's
    # SFTTrainer prints its logs as Python dicts ({'loss': '6.27', ...}), which are not JSON.
    lines = (out or "").splitlines()
    for prefix in ("ROW {", "{"):
        for line in reversed(lines):
            if line.startswith(prefix):
                try:
                    return json.loads(line.removeprefix("ROW "))
                except ValueError:
                    continue
    return {"error": ((out or "").strip().splitlines() or ["no output"])[-1][:300]}


def _estimate(model_dir: str, model: str, policy: str, extra: list[str], dry: bool, gpu: str | None
              ) -> subprocess.Popen:
    args = [x for s in sets(model_dir, model, dry, extra) for x in ("--set", s)]
    return _spawn(["-m", "memfit.cli", "estimate", "--policy", policy, *(["--device", gpu] if gpu else []),
                   *args, "--json"], background=True)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    import torch

    out = {"torch": torch.__version__}
    for name in ("transformers", "peft", "liger-kernel", "torchao", "trl"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def run(out: Path, dry: bool, deadline_s: float, doc: Path | None) -> Path:
    import torch

    from memfit.config.devices import profile_for_report
    from memfit.memory.techniques.optim import flops_per_token

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "rows.log"
    cuda = torch.cuda.is_available()
    gpu_name = torch.cuda.get_device_name() if cuda else "cpu"
    target = ("h200" if "H200" in gpu_name else "h100-80gb" if "H100" in gpu_name else None) if cuda else None
    peak_flops = profile_for_report({"type": "cuda", "name": gpu_name}).flops_per_s("bfloat16") if cuda else None
    mode = "dry" if dry else "real"
    dirs = {m: str(out / f"model-{m}") for m in ("1b", "8b")}
    gens = {"1b": _collect(_spawn([ROWS_SCRIPT, "gen", dirs["1b"], "1b", mode]), 300, log)}
    estimates = {i: _estimate(dirs[r[1]], r[1], r[3], r[4], dry, target) for i, r in enumerate(ROWS)
                 if r[2] == "memfit" and r[1] == "1b"}  # the 8B ones once its folder exists
    results: dict[int, dict] = {}
    for i, (_label, model, runner, policy, extra, cuda_only) in enumerate(ROWS):
        left = deadline_s - (time.time() - t0)
        if cuda_only and not cuda:
            results[i] = {"error": "CUDA only"}
            continue
        if left < 20:
            results[i] = {"error": "not run (the kit's time ran out)"}
            continue
        if model not in gens:
            gens[model] = _collect(_spawn([ROWS_SCRIPT, "gen", dirs[model], model, mode]), min(left, 120), log)
            estimates.update({j: _estimate(dirs[r[1]], r[1], r[3], r[4], dry, target) for j, r in enumerate(ROWS)
                              if r[2] == "memfit" and r[1] == model})
        if runner == TWIN:
            extra = twin_sets(extra, results.get(DPO_ROW, {}))
            if extra is None:
                results[i] = {"error": "no DPO row to match"}
                continue
            estimates[i] = _estimate(dirs[model], model, policy, extra, dry, target)
            runner = "memfit"
        work = str(out / f"work-{i}")
        args = [ROWS_SCRIPT, runner, dirs[model], model, mode, policy, json.dumps(extra), work,
                "traced" if i in TRACED else "-"]
        results[i] = _collect(_spawn(args), min(left, 240), log)
        results[i]["sets"] = extra
    for i, proc in estimates.items():
        est = _collect(proc, max(deadline_s - (time.time() - t0), 5), log)
        results[i]["estimate_bytes"] = est.get("total_bytes") if "error" not in est else None
        results[i]["predicted_step_s"] = est.get("predicted_step_seconds")
    shapes = {m: g.get("n_params") for m, g in gens.items()}
    table = _render(results, gpu_name, peak_flops, dry, shapes, flops_per_token, time.time() - t0)
    (out / "table.json").write_text(json.dumps({"rows": results, "gens": gens, "versions": _versions()}, indent=1))
    path = doc or out / "gpu.md"
    path.write_text(table)
    print(table)
    return path


def _render(results: dict[int, dict], gpu: str, peak_flops: float | None, dry: bool, shapes: dict,
            flops_per_token, seconds: float) -> str:
    gib = 2**20 if dry else 2**30  # the dry run's tiny shapes: MiB
    unit = "MiB" if dry else "GiB"
    lines = [f"| row | estimate {unit} | real peak {unit} | est/real | s/step | predicted s/step | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (label, model, _runner, _policy, _extra, _c) in enumerate(ROWS):
        r = results.get(i, {})
        if "error" in r:
            lines.append(f"| {label} | — | {r['error']} | — | — | — | — | — |")
            continue
        micro, seq = (DRY_JOB if dry else JOB)[model]
        shape = {**json.loads((REPO / "configs/models/llama-3-8b/config.json").read_text()),
                 **(DRY_SHAPES if dry else SHAPES)[model]}
        # The step's computed tokens where the row measured them (a DPO batch is cut to its longest pair).
        tokens = r.get("tokens_per_step") or micro * seq
        if r.get("rows_per_step"):
            seq = max(1, round(tokens / r["rows_per_step"]))
        tps = tokens / r["step_s"] if r.get("step_s") else None
        fpt = flops_per_token(r.get("n_params") or shapes.get(model) or 0, shape["num_hidden_layers"],
                              shape["hidden_size"], seq)
        mfu = f"{fpt * tps / peak_flops:.1%}" if tps and peak_flops else "—"
        est, real, pred = r.get("estimate_bytes"), r.get("peak_bytes"), r.get("predicted_step_s")
        cells = [f"{est / gib:.2f}" if est else "—", f"{real / gib:.2f}" if real else "—",
                 f"{est / real:.3f}" if est and real else "—", f"{r['step_s']:.3f}" if r.get("step_s") else "—",
                 f"{pred:.3f}" if pred else "—", f"{tps / 1e3:.1f}k" if tps else "—", mfu]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    v = _versions()
    lines += [""] + _verdicts(results, dry) + _where(results)
    head = [f"# memfit on a GPU{' (dry run: tiny shapes on the CPU)' if dry else ''}", "",
            f"Measured {datetime.date.today().isoformat()} on {gpu} by `bash bench/gpu_kit.sh run` "
            f"({seconds:.0f} s); " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
            "Random-weight Llama shapes made on the device (configs/models/llama-3-8b/config.json; the 1B rows with "
            "Llama-3.2-1B's widths, tied head), micro-batch x sequence 4 x 2048 (8B: 2 x 2048), bf16-mixed. The "
            "real peak is torch.cuda.max_memory_allocated over the row's own process; the estimate is `memfit "
            "estimate --device <gpu> --policy P`; s/step the median of memfit profile's timed steps (the loop's "
            "and TRL's: of steps 3-6). MFU: PaLM FLOPs per token over the dense bf16 peak. The DPO row: 4 synthetic "
            "pairs a step (8 rows, cut to the batch's longest pair), dpo.reference auto; its estimate plans for the "
            "data's worst batch (its longest pair beside its shortest prompt: the head's positions) with the "
            "reference's no-grad forward where the step runs it, its real peak is over the batches it drew, and its "
            "tokens are the rows x width computed (the reference's forward not counted in MFU); the SFT row after "
            "it trains that many rows of that width. Timed steps below: the first builds the optimizer state.", "",
            "Made by `bash bench/gpu_kit.sh prepare` (here: the wheels the device image lacks, `.whl/`, 25 MiB), then "
            "one device run of `bash bench/gpu_kit.sh run` (carry `.whl`, at most 8 minutes: `pytest -m gpu`, then "
            "`bench/gpu_table.py`); `bash bench/gpu_kit.sh dry` runs the table on tiny shapes on a CPU.", ""]
    return "\n".join(head + lines) + "\n"


def _verdicts(results: dict[int, dict], dry: bool) -> list[str]:
    """The issue's goals, each as the ratio the rows give (or why it is missing)."""
    def step(i: int) -> float | None:
        return results.get(i, {}).get("step_s")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a and b else "not measured"

    tps8 = next((r["tokens_per_step"] / r["step_s"] for i, r in results.items()
                 if ROWS[i][0].startswith("8B LoRA, policy full") and r.get("step_s") and r.get("tokens_per_step")),
                None)
    pred = [r["predicted_step_s"] / r["step_s"] for r in results.values()
            if r.get("predicted_step_s") and r.get("step_s")]
    out = [f"- memfit's default step against the hand-written loop (loop s / memfit s; goal >= 0.98): "
           f"{ratio(step(LOOP), step(DEFAULT))}",
           f"- TRL's SFTTrainer against memfit's default step (TRL s / memfit s): {ratio(step(TRL), step(DEFAULT))}",
           f"- a DPO step against an SFT step on the same rows x width (goal <= 3): "
           f"{ratio(step(DPO_ROW), step(DPO_TWIN))}",
           f"- 8B LoRA, full checkpointing: {f'{tps8 / 1e3:.2f}k tokens/s' if tps8 else 'not measured'} "
           "(goal >= 9k on an H200)",
           f"- predicted / measured step time over {len(pred)} rows: " +
           (f"{min(pred):.2f} to {max(pred):.2f} (goal within 0.85-1.15)" if pred else "not measured")]
    if len(pred) > 1:  # for recalibrating the clock: the one factor that best fits every row, and what it leaves
        scale = math.exp(-statistics.fmean(math.log(x) for x in pred))
        out.append(f"- one factor on every predicted time that fits these rows best (geometric): x{scale:.3f}, "
                   f"leaving {min(pred) * scale:.2f} to {max(pred) * scale:.2f}")
    return out + (["- (a dry run: tiny shapes on a CPU, so these ratios say nothing of a GPU)"] if dry else [])


def _where(results: dict[int, dict]) -> list[str]:
    """Per traced row: each timed step's seconds, then where one step's time went (memfit profile's trace)."""
    from memfit.profile_trace import markdown

    out: list[str] = []
    for i in TRACED:
        r = results.get(i, {})
        if "step_times" not in r:
            continue
        ref = f" dpo.reference ran as {r['reference']}." if r.get("reference") else ""
        out += ["", f"### Where the time goes: {ROWS[i][0]}", "",
                "Timed steps (s): " + ", ".join(f"{t:.3f}" for t in r["step_times"]) + "." + ref]
        if r.get("where"):
            out += ["", *markdown(r["where"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["run"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--doc", type=Path, default=None, help="write the table here too (docs/gpu.md)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, on the CPU")
    ap.add_argument("--deadline-s", type=float, default=250)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    run(a.out, a.dry_run, a.deadline_s, a.doc)


if __name__ == "__main__":
    main()
