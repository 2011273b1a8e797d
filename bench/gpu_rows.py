"""The GPU table's rows: the shapes, the jobs, and each row's child process (memfit, the hand-written loop, TRL).

    python3 bench/gpu_rows.py KIND MODEL_DIR MODEL dry|real [POLICY OVERRIDES_JSON WORK traced|-]   # one ROW line

bench/gpu_table.py runs each row in a process of its own, so the truth, torch.cuda.max_memory_allocated over that
whole process, is read outside memfit.
"""

from __future__ import annotations

import json
import statistics
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
DPO = ["train.objective=dpo", "data.format=preference"]  # memfit's synthetic pairs, dpo.reference auto
TWIN = "twin"  # the runner of the SFT row with the DPO row's rows and width, decided once the DPO row has run
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
    ("1B LoRA DPO, policy full (4 synthetic pairs a step)", "1b", "memfit", "full", LORA + DPO, False),
    ("1B LoRA SFT, policy full, the DPO step's rows x width", "1b", TWIN, "full", LORA, False),
    ("8B LoRA, policy offload", "8b", "memfit", "offload", LORA, True),
]
DEFAULT, LOOP, TRL, DPO_ROW, DPO_TWIN = 0, 3, 4, 9, 10
# Rows whose step is also read from torch.profiler's trace: where the time goes (top kernels, host ops by self time).
TRACED = (DEFAULT, DPO_ROW, DPO_TWIN)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sets(model_dir: str, model: str, dry: bool, extra: list[str]) -> list[str]:
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


def memfit_row(model_dir: str, model: str, policy: str, extra: list[str], dry: bool, work: str, traced: bool
               ) -> dict:
    import torch

    from memfit import config
    from memfit.profile import profile

    cuda = torch.cuda.is_available()
    cfg = config.load(None, [*sets(model_dir, model, dry, extra), f"train.device={_device()}",
                             f"run.work_dir={work}", f"checkpoint.uri={work}/ck"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # Six steps where the trace is read: a DPO batch's width changes every step, so the first of each is seen.
    res = profile(cfg, out_dir=f"{work}/profile", steps=6 if traced else 4, compare=[policy], trace=traced)
    pol = res["policies"][policy]
    real = torch.cuda.max_memory_allocated() if cuda else pol.get("peak_bytes", 0)
    row = {"peak_bytes": real, "step_s": pol.get("step_seconds"), "n_params": res["workload"]["n_params"],
           "description": pol.get("description"), "tokens_per_step": pol.get("tokens_per_step"),
           "step_times": pol.get("step_times"), "reference": pol.get("reference"),
           "rows_per_step": cfg.train.micro_batch_size
           * cfg.train.grad_accum_steps * (2 if cfg.train.objective == "dpo" else 1)}
    if traced and pol.get("where"):
        row["where"] = pol["where"]
    return row


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


def twin_sets(extra: list[str], dpo: dict) -> list[str] | None:
    """The SFT twin of a measured DPO row: as many rows, each as wide as the DPO step's computed tokens make
    them (a DPO batch is cut to its longest pair, so its width is the mean over the timed steps)."""
    if not dpo.get("tokens_per_step") or not dpo.get("rows_per_step"):
        return None
    width = max(8, round(dpo["tokens_per_step"] / dpo["rows_per_step"]))
    return [*extra, f"train.batch_size={dpo['rows_per_step']}", f"data.seq_len={width}"]


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
            row = memfit_row(model_dir, model, argv[4], json.loads(argv[5]), dry, argv[6], argv[7] == "traced")
        elif kind == "bare":
            row = bare_row(model_dir, model, dry)
        else:
            row = trl_row(model_dir, model, dry, argv[6])
    except Exception as err:  # noqa: BLE001 - a row's failure is a cell of the table, not the end of it
        row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
    row["wall_s"] = time.time() - t0
    print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    child(sys.argv[1:])
