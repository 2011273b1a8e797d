"""data.streaming as the corpus grows: one epoch of blocks read from a stream, its time, peak RSS and a resume's.

    PYTHONPATH=. python bench/data_stream.py [--sizes 10000 40000 160000 --work /tmp/memfit-stream]

Each size runs in a fresh process: a generated JSONL (bench/data_scale.py's records and tokenizer, no hub), a
BlockStream of 512-token blocks read to the end of the first epoch 16 blocks at a time (the trainer's calls), then
a new stream restored from the state saved after 1000 blocks (half the epoch in a smaller corpus), timed to its
first 16 blocks (a resume).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ONE = """
import json, resource, sys, time
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/bench"]
from pathlib import Path
from data_scale import generate, tokenizer_dir
from transformers import AutoTokenizer
from memfit.config import DataConfig
from memfit.data.streaming import BlockStream
n, work = int(sys.argv[1]), Path(sys.argv[2])
corpus = work / f"c{n}.jsonl"
if not corpus.exists():
    generate(corpus, n)
tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(work / "tok", corpus)))
data = DataConfig(path=str(corpus), streaming=True, seq_len=512)
s, blocks, states, t0 = BlockStream(data, tok, 0, "fp"), 0, [], time.perf_counter()
while s.epoch == 0:
    blocks += len(s.next_blocks(16))
    if blocks <= 1000:
        states.append((blocks, json.dumps(s.state_dict())))
seconds = time.perf_counter() - t0
state = json.loads(next(st for b, st in states if b >= min(1000, blocks // 2)))
r = BlockStream(data, tok, 0, "fp")
r.load_state_dict(state)
t1 = time.perf_counter()
r.next_blocks(16)
print(json.dumps({"records": n, "MB": round(corpus.stat().st_size / 1e6, 1), "blocks": blocks,
                  "seconds": round(seconds, 1), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF)
                  .ru_maxrss / 1e6, 3), "resume_s": round(time.perf_counter() - t1, 2)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10000, 40000, 160000])
    ap.add_argument("--work", type=Path, default=Path("/tmp/memfit-stream"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for n in args.sizes:
        done = subprocess.run([sys.executable, "-c", ONE, str(n), str(args.work), str(REPO)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            sys.exit(f"data_stream: the run of {n} records failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
