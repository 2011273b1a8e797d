"""bench/gpu_table.py's table: estimate over the real peak, tokens/s and MFU as FACTS computed them by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_table  # noqa: E402

from memfit.memory.techniques.optim import flops_per_token  # noqa: E402

GIB = 2**30


def test_the_1b_row_reads_as_measured_on_the_h200():
    # FACTS, "GPU, measured 2026-12-04": 35.31 GiB estimated, 35.38 real, 0.236 s a step, 34.7k tokens/s, MFU 29 %.
    results = {0: {"estimate_bytes": 35.31 * GIB, "peak_bytes": 35.38 * GIB, "step_s": 0.236, "n_params": 1_235_814_400,
                   "predicted_step_s": 0.382},
               6: {"error": "CUDA only"}}
    table = gpu_table._render(results, "NVIDIA H200", 989e12, False, {}, flops_per_token, 12.0)
    row = next(line for line in table.splitlines() if line.startswith("| 1B full FT, policy none"))
    assert row == "| 1B full FT, policy none (loss auto) | 35.31 | 35.38 | 0.998 | 0.236 | 0.382 | 34.7k | 28.9% |"
    assert "| 1B full FT, full, adamw-cpu-offload | — | CUDA only |" in table
    assert "on NVIDIA H200 by `bash bench/gpu_kit.sh run` (12 s)" in table
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == len(gpu_table.ROWS) + 1


@pytest.mark.parametrize(("printed", "expected"), [
    ('noise\nROW {"step_s": 1.0}\n', {"step_s": 1.0}),  # a child's row
    ('log line\n{"total_bytes": 5}\n', {"total_bytes": 5}),  # memfit estimate --json
    ("Traceback\nValueError: bad\n", {"error": "ValueError: bad"}),
    # TRL's SFTTrainer prints its logs as Python dicts: not rows, and not a reason to fail the table
    ("{'loss': '6.27', 'epoch': '0.17'}\nROW {\"tokens_s\": 9.0}\n{'train_runtime': '0.09'}\n", {"tokens_s": 9.0}),
])
def test_a_childs_output_becomes_its_row(printed, expected, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", f"print({printed!r}, end='')"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert gpu_table._collect(proc, 30, tmp_path / "log") == expected
    assert (tmp_path / "log").read_text() == printed


def test_the_dpo_row_is_weighed_against_sft_on_the_same_rows_and_width():
    dpo = {"step_s": 0.30, "tokens_per_step": 8 * 180, "rows_per_step": 8, "n_params": 1_235_814_400,
           "step_times": [0.9, 0.31, 0.30, 0.29, 0.30], "reference": "adapter_off",
           "where": {"top_kernels_ms": [[41.5, "gemm"]], "top_host_ops_self_ms": [[12.0, "aten::mm"]],
                     "host_ops_ms": 30.0, "gpu_busy_ms": 60.0, "gpu_span_ms": 280.0, "kernels": 4100}}
    # The twin trains 8 rows of 180 tokens: the DPO step's computed tokens.
    assert gpu_table.twin_sets(["lora.enabled=true"], dpo) == [
        "lora.enabled=true", "train.batch_size=8", "data.seq_len=180"]
    assert gpu_table.twin_sets([], {"error": "boom"}) is None
    results = {gpu_table.DPO_ROW: dpo, gpu_table.DPO_TWIN: {"step_s": 0.12, "tokens_per_step": 1440},
               gpu_table.LOOP: {"step_s": 0.187}, gpu_table.DEFAULT: {"step_s": 0.236, "tokens_per_step": 8192}}
    table = gpu_table._render(results, "NVIDIA H200", 989e12, False, {}, flops_per_token, 12.0)
    assert "- a DPO step against an SFT step on the same rows x width (goal <= 3): 2.500" in table
    assert "- memfit's default step against the hand-written loop (loop s / memfit s; goal >= 0.98): 0.792" in table
    assert "- 8B LoRA, full checkpointing: not measured" in table
    # tokens/s of the DPO row: its computed tokens (8 x 180) over its step, not the job's 4 x 2048
    row = next(line for line in table.splitlines() if line.startswith("| 1B LoRA DPO"))
    assert "| 0.300 | — | 4.8k |" in row
    where = table.split("### Where the time goes: 1B LoRA DPO")[1]
    assert "Timed steps (s): 0.900, 0.310, 0.300, 0.290, 0.300. dpo.reference ran as adapter_off." in where
    assert "GPU kernels busy 60.0 ms of the 280.0 ms they span (4100 kernels)" in where
    assert "| 41.50 | `gemm` |" in where


def test_the_clock_check_names_the_factor_that_would_fit_the_rows():
    results = {0: {"step_s": 0.236, "predicted_step_s": 0.382}, 1: {"step_s": 0.188, "predicted_step_s": 0.298}}
    table = gpu_table._render(results, "NVIDIA H200", 989e12, False, {}, flops_per_token, 1.0)
    assert "- predicted / measured step time over 2 rows: 1.59 to 1.62 (goal within 0.85-1.15)" in table
    # FACTS' rows ran 1.619x and 1.585x slow: 1 / sqrt(1.619 x 1.585) = 0.624 brings both to within 1 % of 1
    assert "fits these rows best (geometric): x0.624, leaving 0.99 to 1.01" in table
