"""The benchmarks that build memfit's Trainer and data by hand still run: two of them, and loop_overhead.py, broke
silently when the plan became an object of its own and the inputs a DataSource (found 2026-12-07). Smallest
settings, each in its own process as a developer runs it; the figures are not checked, only that the bench ends
with its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"bench/{script} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_checkpoint_bench_trains_saves_to_s3_and_resumes(tmp_path: Path) -> None:
    """The Trainer built by hand, the snapshot every save takes, saves to a moto server, a resumed child."""
    out = _bench("checkpoint_bench.py", "--hidden", "64", "--layers", "1", "--vocab", "512", "--blocks", "1",
                 "--steps", "2", "--every", "1", "--threads", "1", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert "restart to first resumed step" in out and (tmp_path / "out" / "checkpoint_bench.json").is_file(), out


def test_packing_bench_trains_each_packing_mode(tmp_path: Path) -> None:
    out = _bench("packing_bench.py", "--conversations", "60", "--seq-len", "128", "--hidden", "64", "--layers", "1",
                 "--batch", "2", "--steps", "1", "--rounds", "1", "--threads", "1", cwd=tmp_path)
    rows = [line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["blocks", "padding_free", "none"], out


def test_padding_mask_bench_measures_both_ways_and_finds_the_same_numbers(tmp_path: Path) -> None:
    """SFT and DPO steps on padded rows with their mask and without (docs/preference.md): the same loss and log-probs,
    the peak without the mask no higher."""
    import json

    out = _bench("padding_mask.py", "--small", "--threads", "1", "--out", str(tmp_path), cwd=tmp_path)
    rows = json.loads((tmp_path / "padding_mask.json").read_text())["rows"]
    assert [r["objective"] for r in rows] == ["sft", "dpo"], out
    for r in rows:
        assert r["max_abs_diff"] == 0.0 and r["causal_peak"] <= r["masked_peak"], r


def test_dpo_estimate_bench_writes_its_rows(tmp_path: Path) -> None:
    """Each reference mode's planned and real peak of one DPO step, a row each, and its JSON (docs/preference.md)."""
    out = _bench("dpo_estimate.py", "--small", "--threads", "1", "--out", str(tmp_path), cwd=tmp_path)
    rows = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| 2 blocks")]
    assert rows == ["precompute", "adapter_off", "copy", "precompute"], out
    import json

    assert len(json.loads((tmp_path / "dpo_estimate.json").read_text())["rows"]) == 4
