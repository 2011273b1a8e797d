"""Where one step's time goes, read from its torch.profiler trace: GPU busy vs span, top kernels, host ops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOP = 8


def where_time_goes(trace: dict[str, Any], top: int = TOP) -> dict[str, Any]:
    """A Chrome trace (torch.profiler's export) summed: the time the GPU's kernels kept it busy beside the span they
    cover (a step the host holds back shows a span much longer than its busy time), the kernels that take it, and
    the host's aten ops by self time (an op's own time, its children's taken out, so nested calls are not counted
    twice; on a CPU run that is the step's time)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_kernel: dict[str, float] = {}
    for e in kernels:
        by_kernel[e["name"]] = by_kernel.get(e["name"], 0.0) + float(e["dur"])
    by_op: dict[str, float] = {}
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for ops in threads.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent before the children that start with it
        stack: list[int] = []
        own = [float(e["dur"]) for e in ops]
        for i, e in enumerate(ops):
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= float(e["dur"])
            stack.append(i)
        for e, t in zip(ops, own, strict=True):
            by_op[e["name"]] = by_op.get(e["name"], 0.0) + max(t, 0.0)
    out: dict[str, Any] = {"top_kernels_ms": _top(by_kernel, top), "top_host_ops_self_ms": _top(by_op, top),
                           "host_ops_ms": round(sum(by_op.values()) / 1e3, 3)}
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    if ops:  # what the host's ops span: much more than their self times is host time outside torch's ops (Python)
        out["host_span_ms"] = round((max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)) / 1e3, 3)
    # Where the host waited for the device: a read of a device value (.item(), float(), a tensor's truth) is an
    # aten::_local_scalar_dense op that calls the CUDA runtime (the copy back) and returns only when the GPU has run
    # everything queued before it; a read of a host tensor (an optimizer's step counter) calls nothing. Explicit
    # synchronizations outside such reads are runtime calls of their own. A CPU run has neither.
    # Only the copies and waits are looked at (a GPU step's trace holds a runtime launch call per kernel).
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
               and ("Memcpy" in e["name"] or "Synchronize" in e["name"])]
    reads = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::_local_scalar_dense"
             and any(_inside(r, e) for r in runtime)]
    syncs = [e for e in runtime if "Synchronize" in e["name"] and not any(_inside(e, r) for r in reads)]
    out["device_reads"], out["device_reads_ms"] = len(reads), round(sum(float(e["dur"]) for e in reads) / 1e3, 3)
    out["syncs"], out["syncs_ms"] = len(syncs), round(sum(float(e["dur"]) for e in syncs) / 1e3, 3)
    if kernels:
        out["kernels"] = len(kernels)
        out["gpu_busy_ms"] = round(_union(kernels) / 1e3, 3)
        out["gpu_span_ms"] = round((max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3, 3)
    return out


def read(path: str | Path) -> dict[str, Any]:
    return where_time_goes(json.loads(Path(path).read_text()))


def markdown(where: dict[str, Any]) -> list[str]:
    """The summary as modules.md shows it: one line of totals, then the two top lists as tables."""
    host = f"host ops {where['host_ops_ms']:.1f} ms (self time, summed over threads)" + (
        f" in the {where['host_span_ms']:.1f} ms they span" if "host_span_ms" in where else "")
    if "gpu_busy_ms" in where:
        lines = [f"GPU kernels busy {where['gpu_busy_ms']:.1f} ms of the {where['gpu_span_ms']:.1f} ms they span "
                 f"({where['kernels']} kernels); {host}."]
    else:
        lines = [host[0].upper() + host[1:] + "."]
    if where.get("device_reads") or where.get("syncs"):
        lines[0] += (f" The host waited for the GPU: {where['device_reads']} read(s) of a device value "
                     f"({where['device_reads_ms']:.1f} ms), {where['syncs']} other synchronization(s) "
                     f"({where['syncs_ms']:.1f} ms).")
    for key, title in (("top_kernels_ms", "kernel"), ("top_host_ops_self_ms", "host op, self time")):
        if where.get(key):
            lines += ["", f"| ms | {title} |", "|---:|---|"]
            lines += [f"| {ms:.2f} | `{name[:100].replace('|', '/').replace('`', '')}` |" for ms, name in where[key]]
    return lines


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    """Whether `inner` ran within `outer` on the same thread (a runtime call an op made)."""
    return (inner.get("pid"), inner.get("tid")) == (outer.get("pid"), outer.get("tid")) and \
        outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _top(times: dict[str, float], top: int) -> list[list[Any]]:
    return [[round(t / 1e3, 3), name] for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:top]]


def _union(events: list[dict[str, Any]]) -> float:
    """Microseconds during which at least one of the events ran (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = float(e["ts"]), float(e["ts"] + e["dur"])
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
