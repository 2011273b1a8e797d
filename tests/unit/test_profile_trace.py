"""Where a traced step's time goes: self times of nested host ops, kernels on overlapping streams."""

from __future__ import annotations

import torch

from memfit.profile_trace import markdown, where_time_goes


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_nested_host_ops_count_their_own_time_once():
    # aten::linear (0-100) holds aten::addmm (10-90), which holds a copy (20-30); another thread's op apart.
    trace = {"traceEvents": [op("aten::linear", 0, 100), op("aten::addmm", 10, 80), op("aten::copy_", 20, 10),
                             op("aten::addmm", 200, 40), op("aten::mul", 0, 50, tid=2),
                             {"ph": "i", "name": "[memory]", "ts": 5}]}
    where = where_time_goes(trace)
    assert dict((name, ms) for ms, name in where["top_host_ops_self_ms"]) == {
        "aten::addmm": 0.11, "aten::mul": 0.05, "aten::linear": 0.02, "aten::copy_": 0.01}
    assert where["host_ops_ms"] == 0.19  # the two threads' self times: 140 + 50 us
    assert where["host_span_ms"] == 0.24  # from the first op's start to the last one's end
    assert markdown(where)[0] == "Host ops 0.2 ms (self time, summed over threads) in the 0.2 ms they span."
    assert "gpu_busy_ms" not in where


def test_kernels_busy_time_is_their_union_and_the_span_shows_the_gaps():
    trace = {"traceEvents": [op("gemm", 1000, 300, cat="kernel"), op("gemm", 1200, 300, cat="kernel"),  # overlap
                             op("softmax", 3000, 100, cat="kernel"), op("aten::mm", 900, 50)]}
    where = where_time_goes(trace)
    assert where["gpu_busy_ms"] == 0.6 and where["gpu_span_ms"] == 2.1 and where["kernels"] == 3
    assert where["top_kernels_ms"] == [[0.6, "gemm"], [0.1, "softmax"]]
    text = "\n".join(markdown(where))
    assert text.startswith("GPU kernels busy 0.6 ms of the 2.1 ms they span (3 kernels); host ops 0.1 ms (self "
                           "time, summed over threads) in the 0.1 ms they span.")
    assert "| 0.60 | `gemm` |" in text


def test_a_real_profiler_trace_names_the_matmuls(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            a = torch.tanh(a @ b)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    import json

    where = where_time_goes(json.loads((tmp_path / "t.json").read_text()))
    names = [name for _, name in where["top_host_ops_self_ms"]]
    assert "aten::mm" in names and "aten::tanh" in names
    # torch's own table agrees on the matmul's self time (to rounding: the trace's times are whole microseconds)
    ours = next(ms for ms, name in where["top_host_ops_self_ms"] if name == "aten::mm")
    theirs = next(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::mm") / 1e3
    assert abs(ours - theirs) <= 0.02 * theirs + 0.05


def test_the_hosts_waits_for_the_device_are_counted():
    # Two reads of a device value (each calls the runtime for the copy back and returns when the GPU has caught
    # up: 4 ms and 1 ms), a read of a host tensor (an optimizer's step counter: no runtime call, no wait), and one
    # synchronization of its own: what holds a step back when its GPU span is much longer than its busy time.
    trace = {"traceEvents": [
        op("aten::item", 0, 4100), op("aten::_local_scalar_dense", 50, 4000),
        op("cudaMemcpyAsync", 60, 3980, cat="cuda_runtime"), op("cudaStreamSynchronize", 4040, 5, cat="cuda_runtime"),
        op("aten::_local_scalar_dense", 9000, 1000), op("cudaMemcpyAsync", 9010, 980, cat="cuda_runtime"),
        op("aten::_local_scalar_dense", 11000, 3),  # a host tensor's
        op("cudaStreamSynchronize", 12000, 2500, cat="cuda_runtime"),
        op("cudaLaunchKernel", 15000, 10, cat="cuda_runtime"), op("gemm", 100, 3900, cat="kernel")]}
    where = where_time_goes(trace)
    assert (where["device_reads"], where["device_reads_ms"], where["syncs"], where["syncs_ms"]) == (2, 5.0, 1, 2.5)
    assert markdown(where)[0].endswith("The host waited for the GPU: 2 read(s) of a device value (5.0 ms), 1 other "
                                       "synchronization(s) (2.5 ms).")
    assert "waited" not in markdown(where_time_goes({"traceEvents": [op("aten::mm", 0, 10)]}))[0]


def test_a_cpu_trace_reads_no_device_value(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            float((a @ a).sum())  # three reads, of host tensors: no wait for any device
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    import json

    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e.get("name") == "aten::_local_scalar_dense" for e in events) == 3
    assert where_time_goes({"traceEvents": events})["device_reads"] == 0
