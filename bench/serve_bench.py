"""memfit serve-model under bounded load: N concurrent clients on 127.0.0.1, p50/p95 latency and tokens/s per backend.

    PYTHONPATH=. python bench/serve_bench.py [--model MODEL] [--backends transformers,onnx,llama.cpp:f16,llama.cpp:q8_0]
        [--clients 1,4,8] [--requests 24] [--max-tokens 32]

Without --model it trains the tiny champion (configs/tiny.yaml, a few steps, SafeTensors + ONNX, and GGUF f16 + q8_0
when a llama.cpp backend is asked for; registered in a SQLite MLflow store in a temporary folder) and serves
models:/tiny@champion. A backend `llama.cpp:QUANT` serves the export's GGUF file of that quant (serve.gguf_quant).
Each backend gets its own server in this process, on a free port of 127.0.0.1; for each client count, every client
sends its share of --requests greedy completions one after another (a different prompt each, max_tokens fixed), so
the server sees at most N requests at once. Latency is a request's time to its last byte; tokens/s is completion
tokens over wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
PROMPTS = ["the cat", "one two three", "a red house by the sea", "numbers: 4 5", "hello world", "blue and green"]


def load(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    tokens = [0]
    errors = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(k, requests, clients):
                body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": max_tokens,
                        "temperature": 0}
                t = time.perf_counter()
                r = http.post("/v1/completions", json=body)
                dt = time.perf_counter() - t
                with lock:
                    if r.status_code != 200:
                        errors[0] += 1
                        continue
                    latencies.append(dt)
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=20) if len(latencies) >= 2 else latencies * 19
    return {"p50_ms": 1000 * statistics.median(latencies), "p95_ms": 1000 * q[18], "tokens_per_s": tokens[0] / wall,
            "requests": len(latencies), "errors": errors[0], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="MODEL to serve (default: a freshly trained tiny champion)")
    ap.add_argument("--config", type=Path, help="config for --model (tracking.uri, serve.*)")
    ap.add_argument("--backends", default="transformers,onnx", help="comma-separated: transformers, onnx, "
                    "llama.cpp:f16, llama.cpp:q8_0, llama.cpp:q4_k_m")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=24, help="requests per client count, split over the clients")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="serve.max_batch_size")
    args = ap.parse_args()

    from memfit import config
    from memfit.runtime.telemetry import set_telemetry_off
    from memfit.server.run import start_in_thread

    set_telemetry_off()
    tmp = tempfile.TemporaryDirectory(prefix="memfit-serve-bench-")
    if args.model:
        cfg = config.load(args.config, [])
    else:
        from serve_support import train_champion

        quants = sorted({b.partition(":")[2] or "q8_0" for b in args.backends.split(",") if b.startswith("llama.cpp")})
        gguf = {"export.formats": "[safetensors,onnx,gguf]", "export.gguf_quants": f"[{','.join(quants)}]"}
        print("training the tiny champion (a few steps, SafeTensors + ONNX) ...", file=sys.stderr)
        cfg, _ = train_champion(Path(tmp.name), steps=8, onnx=True, **(gguf if quants else {}))
    rows = []
    for backend in args.backends.split(","):
        kind, _, quant = backend.partition(":")
        run_cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={
            "backend": kind, "gguf_quant": quant or "q8_0", "max_batch_size": args.batch, "follow_alias": False})})
        server = start_in_thread(run_cfg, args.model, port=0)
        try:
            load(server.url, 2, 4, args.max_tokens)  # warm-up: first-call allocations, onnxruntime's arenas
            for clients in (int(c) for c in args.clients.split(",")):
                rows.append((backend, clients, load(server.url, clients, args.requests, args.max_tokens)))
        finally:
            server.stop()
    print(f"\n{args.requests} greedy completions of max_tokens={args.max_tokens} per row, serve.max_batch_size="
          f"{args.batch}, on 127.0.0.1\n")
    print("| backend | clients | p50 ms | p95 ms | tokens/s | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for backend, clients, r in rows:
        print(f"| {backend} | {clients} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['errors']} |")
    by = {(b, c): r["tokens_per_s"] for b, c, r in rows}
    for clients in sorted({c for _, c, _ in rows}):
        for other in (b for b, c, _ in rows if c == clients and b != "transformers"):
            if ("transformers", clients) in by:
                print(f"{other} / transformers tokens/s at {clients} clients: "
                      f"{by[other, clients] / by['transformers', clients]:.2f}x")
    tmp.cleanup()


if __name__ == "__main__":
    main()
