"""The GPU table: memfit's estimate vs the allocator's real peak, memfit vs a hand-written loop and TRL's SFTTrainer.

    python3 bench/gpu_table.py run --out DIR [--doc docs/gpu.md] [--deadline-s 250]   # on the GPU (gpu_kit.sh run)
    python3 bench/gpu_table.py run --out DIR --dry-run                                  # tiny shapes on the CPU

Random-weight Llama shapes are made on the device from configs/models/llama-3-8b/config.json (the 1B row:
Llama-3.2-1B's widths) with a small tokenizer memfit trains; every row runs in a fresh process, so the truth,
torch.cuda.max_memory_allocated over that whole process, is read outside memfit. memfit rows: `memfit profile`
(real optimizer steps through the Trainer `memfit run` uses); estimates: `memfit estimate --device <gpu> --json`,
run beside the GPU rows (they use the CPU). MFU: PaLM's FLOPs per token over the device's dense bf16 peak.
Rows past the deadline are listed as not run; the table is written whatever happened.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # config.json overrides of Llama-3-8B's; the dry run's are tiny
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": True},
    "8b": {},
}
DRY_SHAPES = {"1b": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True},
              "8b": {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512}}
JOB = {"1b": (4, 2048), "8b": (2, 2048)}  # micro-batch x sequence
DRY_JOB = {"1b": (2, 64), "8b": (2, 64)}
LORA = ["lora.enabled=true"]
# (label, model, runner, policy, memfit overrides, CUDA only)
ROWS = [
    ("1B full FT, policy none (loss auto)", "1b", "memfit", "none", [], False),
    ("1B full FT, none, plain loss + adamw-fused", "1b", "memfit", "none",
     ["memory.loss=plain", "memory.optimizer=adamw-fused"], False),
    ("1B full FT, none, fused loss (Liger)", "1b", "memfit", "none", ["memory.loss=fused"], False),
    ("hand-written loop (HF model, autocast, fused AdamW, clip)", "1b", "bare", "none", [], False),
    ("TRL SFTTrainer (same job, no checkpointing)", "1b", "trl", "none", [], False),
    ("1B full FT, policy full", "1b", "memfit", "full", [], False),
    ("1B full FT, full, adamw-cpu-offload", "1b", "memfit", "full", ["memory.optimizer=adamw-cpu-offload"], True),
    ("1B LoRA, policy full", "1b", "memfit", "full", LORA, False),
    ("8B LoRA, policy full, micro 2 x 2048", "8b", "memfit", "full", LORA, False),
    ("8B LoRA, policy offload", "8b", "memfit", "offload", LORA, True),
]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sets(model_dir: str, model: str, dry: bool, extra: list[str]) -> list[str]:
    micro, seq = (DRY_JOB if dry else JOB)[model]
    precision = "fp32" if dry else "bf16-mixed"
    return [f"model.name_or_path={model_dir}", "model.preset=null", "tracking.backend=null",
            f"data.seq_len={seq}", f"train.batch_size={micro}", "train.grad_accum_steps=1",
            f"train.precision={precision}", *extra]


# -- children: each prints one ROW line ----------------------------------------------------------------------
def gen(out: str, model: str, dry: bool) -> None:
    """A random-weight bf16 folder of the shape, made on the device, with a tokenizer memfit trains."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.data.synthetic import synthetic_corpus
    from memfit.models.loading import train_tokenizer

    t0 = time.time()
    shape = json.loads((REPO / "configs" / "models" / "llama-3-8b" / "config.json").read_text())
    shape.update((DRY_SHAPES if dry else SHAPES)[model])
    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k not in ("architectures", "transformers_version")})
    with torch.device(_device()):
        net = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    net.save_pretrained(out, max_shard_size="4GB")
    train_tokenizer(synthetic_corpus(200, seed=0), 512, Path(out))
    n = sum(p.numel() for p in net.parameters())
    print("ROW " + json.dumps({"gen": model, "n_params": n, "seconds": time.time() - t0}), flush=True)


def memfit_row(model_dir: str, model: str, policy: str, extra: list[str], dry: bool, work: str) -> dict:
    import torch

    from memfit import config
    from memfit.profile import profile

    cuda = torch.cuda.is_available()
    cfg = config.load(None, [*_sets(model_dir, model, dry, extra), f"train.device={_device()}",
                             f"run.work_dir={work}", f"checkpoint.uri={work}/ck"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = profile(cfg, out_dir=f"{work}/profile", steps=4, compare=[policy])
    pol = res["policies"][policy]
    real = torch.cuda.max_memory_allocated() if cuda else pol.get("peak_bytes", 0)
    return {"peak_bytes": real, "step_s": pol.get("step_seconds"), "n_params": res["workload"]["n_params"],
            "description": pol.get("description")}


def bare_row(model_dir: str, model: str, dry: bool) -> dict:
    """A plain PyTorch loop over the same HF model: fp32 weights, bf16 autocast (CUDA), fused AdamW, clip 1.0."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = _device()
    micro, seq = (DRY_JOB if dry else JOB)[model]
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    net.config.use_cache = False
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=dev == "cuda")
    ids = torch.randint(0, 500, (micro, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    times = []
    for _ in range(6):
        _sync()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    return {"peak_bytes": peak, "step_s": statistics.median(times[2:]), "n_params": net.num_parameters()}


def trl_row(model_dir: str, model: str, dry: bool, work: str) -> dict:
    """TRL's SFTTrainer on the same rows (pre-tokenized, no packing, no checkpointing, bf16, fused AdamW)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dev = _device()
    micro, seq = (DRY_JOB if dry else JOB)[model]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            _sync()
            times.append(time.perf_counter() - self.t)

    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, 500, (micro * 6, seq), generator=torch.Generator().manual_seed(0))
    args = SFTConfig(output_dir=work, per_device_train_batch_size=micro, max_steps=6, learning_rate=1e-5,
                     bf16=dev == "cuda", gradient_checkpointing=False, max_length=seq, packing=False,
                     optim="adamw_torch_fused" if dev == "cuda" else "adamw_torch", adam_beta2=0.95,
                     max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=dev != "cuda",
                     dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False,
                     dataloader_num_workers=0, model_init_kwargs=None)
    trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    return {"peak_bytes": peak, "step_s": statistics.median(times[2:] or times), "n_params": net.num_parameters()}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child(argv: list[str]) -> None:
    kind, model_dir, model, dry = argv[0], argv[1], argv[2], argv[3] == "dry"
    t0 = time.time()
    try:
        if kind == "gen":
            return gen(model_dir, model, dry)
        if kind == "memfit":
            row = memfit_row(model_dir, model, argv[4], json.loads(argv[5]), dry, argv[6])
        elif kind == "bare":
            row = bare_row(model_dir, model, dry)
        else:
            row = trl_row(model_dir, model, dry, argv[6])
    except Exception as err:  # noqa: BLE001 - a row's failure is a cell of the table, not the end of it
        row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
    row["wall_s"] = time.time() - t0
    print("ROW " + json.dumps(row), flush=True)


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
    sets = [x for s in _sets(model_dir, model, dry, extra) for x in ("--set", s)]
    return _spawn(["-m", "memfit.cli", "estimate", "--policy", policy, *(["--device", gpu] if gpu else []),
                   *sets, "--json"], background=True)


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
    gens = {"1b": _collect(_spawn([__file__, "child", "gen", dirs["1b"], "1b", mode]), 300, log)}
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
            gens[model] = _collect(_spawn([__file__, "child", "gen", dirs[model], model, mode]), min(left, 120), log)
            estimates.update({j: _estimate(dirs[r[1]], r[1], r[3], r[4], dry, target) for j, r in enumerate(ROWS)
                              if r[2] == "memfit" and r[1] == model})
        work = str(out / f"work-{i}")
        args = [__file__, "child", runner, dirs[model], model, mode, policy, json.dumps(extra), work]
        results[i] = _collect(_spawn(args), min(left, 240), log)
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
        tps = micro * seq / r["step_s"] if r.get("step_s") else None
        fpt = flops_per_token(r.get("n_params") or shapes.get(model) or 0, shape["num_hidden_layers"],
                              shape["hidden_size"], seq)
        mfu = f"{fpt * tps / peak_flops:.1%}" if tps and peak_flops else "—"
        est, real, pred = r.get("estimate_bytes"), r.get("peak_bytes"), r.get("predicted_step_s")
        cells = [f"{est / gib:.2f}" if est else "—", f"{real / gib:.2f}" if real else "—",
                 f"{est / real:.3f}" if est and real else "—", f"{r['step_s']:.3f}" if r.get("step_s") else "—",
                 f"{pred:.3f}" if pred else "—", f"{tps / 1e3:.1f}k" if tps else "—", mfu]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    v = _versions()
    head = [f"# memfit on a GPU{' (dry run: tiny shapes on the CPU)' if dry else ''}", "",
            f"Measured {datetime.date.today().isoformat()} on {gpu} by `bash bench/gpu_kit.sh run` "
            f"({seconds:.0f} s); " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
            "Random-weight Llama shapes made on the device (configs/models/llama-3-8b/config.json; the 1B rows with "
            "Llama-3.2-1B's widths, tied head), micro-batch x sequence 4 x 2048 (8B: 2 x 2048), bf16-mixed. The "
            "real peak is torch.cuda.max_memory_allocated over the row's own process; the estimate is `memfit "
            "estimate --device <gpu> --policy P`; s/step the median of memfit profile's timed steps (the loop's "
            "and TRL's: of steps 3-6). MFU: PaLM FLOPs per token over the dense bf16 peak.", "",
            "Made by `bash bench/gpu_kit.sh prepare` (here: the wheels the device image lacks, `.whl/`, 25 MiB), then "
            "one device run of `bash bench/gpu_kit.sh run` (carry `.whl`, at most 8 minutes: `pytest -m gpu`, then "
            "`bench/gpu_table.py`); `bash bench/gpu_kit.sh dry` runs the table on tiny shapes on a CPU.", ""]
    return "\n".join(head + lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.path.insert(0, str(REPO))
        return child(sys.argv[2:])
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
