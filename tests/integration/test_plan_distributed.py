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
    # The plan is one rank's: its stack is held to the budget as fsdp2 divides it, so phase 2 would not refuse a run
    # whose step fits eight GPUs but not one (it did when each rank was planned as a whole replica).
    assert out["fits"] is True and out["predicted_peak_bytes"] == fsdp["total"] and "per rank (fsdp2" in out["reason"]


def test_full_fine_tuning_dpo_on_8_gpus_shards_rather_than_copy_the_reference_onto_each_replica():
    args = ["plan", str(REPO / "configs" / "llama-3-8b-dpo-lora.yaml"), "--set", "lora.enabled=false",
            "--set", "distributed.nproc_per_node=8", "--set", "train.batch_size=8", "--set", "train.grad_accum_steps=1",
            "--device", "h100-80gb", "--json"]
    res = cli_in_process(*args)
    assert res.exit_code == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    d = out["distributed"]
    ddp, fsdp, zero2 = (d["strategies"][s] for s in ("ddp", "fsdp2", "deepspeed_zero2"))
    # A replica holds the frozen reference copy whole (a copy of the module is never sharded) ...
    assert ddp["reference"] == zero2["reference"] == out["weight_bytes"] > 30e9
    # ... fsdp2 splits the weights, so its ranks precompute the reference log-probs and hold no copy.
    assert fsdp["reference"] == 0 and d["strategy"] == "fsdp2" and "DPO reference copy" in d["reason"]
    assert ddp["total"] > d["budget_bytes"] > fsdp["total"] == out["predicted_peak_bytes"]
