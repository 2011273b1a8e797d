"""`memfit plan` with several GPUs: per-GPU memory under each sharding strategy, from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests_support import cli_in_process

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_llama_3_8b_on_8_gpus_with_fsdp_shows_sharded_per_gpu_memory():
    args = ["plan", str(REPO / "configs" / "llama-3-8b-lora.yaml"), "--set", "lora.enabled=false",
            "--set", "distributed.nproc_per_node=8", "--set", "distributed.strategy=fsdp2",
            "--set", "train.batch_size=8", "--set", "train.grad_accum_steps=1", "--device", "h100-80gb", "--json"]
    res = cli_in_process(*args)
    assert res.exit_code == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    d = out["distributed"]
    assert d["world_size"] == 8 and d["strategy"] == "fsdp2" and d["fits"] is True
    ddp, fsdp = d["strategies"]["ddp"], d["strategies"]["fsdp2"]
    # A single replica does not fit an 80 GB GPU; sharded eight ways it does.
    assert ddp["total"] > 80e9 and d["per_gpu_bytes"] == fsdp["total"] < d["budget_bytes"]
    assert fsdp["params"] * 8 == pytest.approx(ddp["params"], rel=1e-3)
    assert fsdp["optim"] * 8 == pytest.approx(ddp["optim"], rel=1e-3)
    assert out["fits"] is False  # the same step as ONE process would not fit: that is why it is sharded
