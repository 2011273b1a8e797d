"""Data preparation as the corpus grows: memfit against the plain datasets path, time and peak RSS, side by side.

    PYTHONPATH=. python bench/data_scale.py [--sizes 100000 400000 1600000 --num-proc 2 --out docs]
    PYTHONPATH=. python bench/data_scale.py --format messages --sizes 25000 100000   # conversations

Each size: a generated JSONL of one `text` field (about 580 bytes, 330 tokens a record, as issue 40's corpus), a
byte-level BPE tokenizer trained here once (no hub). Both paths run in a fresh process each, under a sampler that
adds up the resident memory (RSS, and PSS, which counts a page shared by forked workers once) of
the process and all its children every 100 ms:
  memfit    DataSource(...).digest() + cache.cached_data(...): the records checked and digested, tokenised with
            data.num_proc workers, packed into 512-token blocks, split, written as .npy (what a run does once);
  datasets  load_dataset("json") + a batched tokenizer map (num_proc) + group_texts into 512-token blocks, Arrow
            on disk (how TRL and Axolotl prepare a corpus).
Goals (issue 40): memfit's peak grows < 10 % from the smallest to the largest size, stays within 1.5x the datasets
path's, and its time within 1.2x. Results go to <out>/data_scale.json and <out>/data_scale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 512


def _words() -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(20000)]


def generate(path: Path, n: int, seed: int = 0, fmt: str = "text") -> None:
    """n records of about 580 bytes of word-like text (Zipf-ish word choice, so BPE merges are realistic); for
    messages, the same words as a conversation: a system line, then two user / assistant exchanges."""
    from itertools import accumulate

    words = _words()
    cum = list(accumulate(1.0 / (i + 1) for i in range(len(words))))
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choices(words, cum_weights=cum, k=k)) + "."

    with path.open("w") as f:
        for _ in range(n):
            if fmt == "text":
                record = {"text": say(90)}
            else:
                turns = [("system", 8), ("user", 16), ("assistant", 30), ("user", 12), ("assistant", 24)]
                record = {"messages": [{"role": role, "content": say(k)} for role, k in turns]}
            f.write(json.dumps(record) + "\n")


def _record_text(record: dict) -> str:
    return record.get("text") or " ".join(t["content"] for t in record["messages"])


def tokenizer_dir(out: Path, corpus: Path) -> Path:
    """A byte-level BPE (vocab 1024) trained on the first 20 k records, saved as a transformers folder."""
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    with corpus.open() as f:
        for line, _ in zip(f, range(20000), strict=False):
            texts.append(_record_text(json.loads(line)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    # ChatML with generation markers: both paths can mark the assistant turns (memfit's built-in chatml)
    from memfit.data.templates import BUILTIN_TEMPLATES

    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = BUILTIN_TEMPLATES["chatml"]
    fast.save_pretrained(str(out))
    return out


MEMFIT = """
import resource, sys, time
from transformers import AutoTokenizer
from memfit import config
from memfit.data.cache import cached_data
from memfit.data.source import DataSource
corpus, tok_dir, work, num_proc, fmt = sys.argv[1:6]
tok = AutoTokenizer.from_pretrained(tok_dir)
chat = ["data.train_on=assistant", "data.packing=padding_free"] if fmt == "messages" else []
cfg = config.load(None, [f"data.path={corpus}", f"run.work_dir={work}", "data.seq_len=512",
                         f"data.num_proc={num_proc}", *chat])
t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
source = DataSource(cfg.data, cfg.run.work_dir)
bundle = cached_data(cfg, source, None, tok)
cpu = resource.getrusage(resource.RUSAGE_SELF)
# this process's own CPU (the workers' is not in it): the serial part, which bounds the gain from more cores
parent = cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime
print("ROWS", len(bundle.train) + len(bundle.val), "SECONDS", time.perf_counter() - t0, "PARENT_CPU", parent)
"""

DATASETS = """
import sys, time
from itertools import chain
import datasets
from transformers import AutoTokenizer
datasets.utils.disable_progress_bars()
corpus, tok_dir, work, num_proc, fmt = sys.argv[1:6]
num_proc = int(num_proc)
tok = AutoTokenizer.from_pretrained(tok_dir)
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=work)
if fmt == "messages":  # TRL's assistant_only_loss: the template's generation markers give the mask
    ds = ds.map(lambda b: tok.apply_chat_template(b["messages"], tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True), batched=True,
                num_proc=num_proc, remove_columns=["messages"])
    ds = ds.remove_columns([c for c in ds.column_names if c not in ("input_ids", "assistant_masks")])
else:
    ds = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=num_proc, remove_columns=["text"])
def group_texts(batch):
    joined = {k: list(chain(*batch[k])) for k in batch}
    n = len(joined["input_ids"]) // 512 * 512
    return {k: [v[i:i + 512] for i in range(0, n, 512)] for k, v in joined.items()}
ds = ds.map(group_texts, batched=True, num_proc=num_proc)
print("ROWS", len(ds), "SECONDS", time.perf_counter() - t0)
"""


def measure(script: str, args: list[str]) -> dict[str, float]:
    """Wall time, the script's own figure, and the peak of the summed RSS of the process tree (100 ms samples)."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    root, peak, peak_pss = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        rss = pss = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    info = p.memory_full_info()
                    rss, pss = rss + info.rss, pss + info.pss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"bench failed ({proc.returncode}):\n{err[-3000:]}")
    fields = out.split()
    row = {"wall_s": round(wall, 1), "prepare_s": round(float(fields[fields.index("SECONDS") + 1]), 1),
           "rows": int(fields[fields.index("ROWS") + 1]), "peak_rss_gb": round(peak / 1e9, 3),
           "peak_pss_gb": round(peak_pss / 1e9, 3)}
    if "PARENT_CPU" in fields:
        row["parent_cpu_s"] = round(float(fields[fields.index("PARENT_CPU") + 1]), 1)
    return row


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("memfit", "datasets"):
        xs = [r["records"] / 1000 for r in results]
        a.plot(xs, [r[name]["peak_rss_gb"] for r in results], "o-", label=name)
        b.plot(xs, [r[name]["wall_s"] for r in results], "o-", label=name)
    a.set(xlabel="records (thousands)", ylabel="peak RSS, process tree (GB)", title="memory", ylim=(0, None))
    b.set(xlabel="records (thousands)", ylabel="seconds (process wall time)", title="time", ylim=(0, None))
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 400_000, 1_600_000])
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    ap.add_argument("--scratch", type=Path, default=None, help="where corpora and caches go (default: a temp dir)")
    ap.add_argument("--format", choices=["text", "messages"], default="text",
                    help="messages: conversations, memfit with train_on assistant + padding_free, the datasets path "
                         "with apply_chat_template's assistant masks (TRL's assistant_only_loss)")
    ap.add_argument("--merge", action="store_true", help="keep <out>/data_scale.json's rows of other sizes (each "
                    "row says when and under what load it was measured)")
    args = ap.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="memfit-data-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.sizes:
        corpus = scratch / f"corpus-{args.format}-{n}.jsonl"
        if not corpus.is_file():
            generate(corpus, n, fmt=args.format)
        tok = tokenizer_dir(scratch / f"tokenizer-{args.format}", corpus)
        row = {"records": n, "mb": round(corpus.stat().st_size / 1e6, 1),
               "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg()[0]}
        for name, script in (("memfit", MEMFIT), ("datasets", DATASETS)):
            with tempfile.TemporaryDirectory(dir=scratch) as work:
                row[name] = measure(script, [str(corpus), str(tok), work, str(args.num_proc), args.format])
        row["rss_ratio"] = round(row["memfit"]["peak_rss_gb"] / row["datasets"]["peak_rss_gb"], 2)
        row["time_ratio"] = round(row["memfit"]["wall_s"] / row["datasets"]["wall_s"], 2)
        row["load_after"] = os.getloadavg()[0]
        results.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "data_scale" if args.format == "text" else f"data_scale_{args.format}"
    previous = args.out / f"{stem}.json"
    kept: dict = json.loads(previous.read_text()) if args.merge and previous.is_file() else {}
    others = [r for r in kept.get("results", []) if r["records"] not in args.sizes]
    results = sorted(others + results, key=lambda r: r["records"])
    kept.update({"num_proc": args.num_proc, "seq_len": SEQ_LEN, "format": args.format, "results": results})
    previous.write_text(json.dumps(kept, indent=1) + "\n")
    plot(results, args.out / f"{stem}.png")
    print("| records | MB | blocks | memfit RSS / PSS GB | datasets RSS / PSS GB | RSS ratio | memfit s | datasets s "
          "| time ratio | memfit parent CPU s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        m, d = r["memfit"], r["datasets"]
        print(f"| {r['records']:,} | {r['mb']} | {m['rows']:,} | {m['peak_rss_gb']} / {m['peak_pss_gb']} | "
              f"{d['peak_rss_gb']} / {d['peak_pss_gb']} | {r['rss_ratio']} | {m['wall_s']} | {d['wall_s']} | "
              f"{r['time_ratio']} | {m.get('parent_cpu_s', '')} |")


if __name__ == "__main__":
    main()
