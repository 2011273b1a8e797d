"""Scale-out pieces without processes: config checks, the torchrun command, DeepSpeed's JSON, the way rank
errors come back, the planner's strategy, and reading DCP checkpoints without trusting pickles (the launcher
with stand-in rank processes is in tests/integration/test_torchrun_launcher.py)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from memfit import config
from memfit.errors import CheckpointError, ConfigError, DataError, DistributedError, Preempted

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return config.load(REPO / "configs" / "tiny.yaml", list(overrides))


# -- config ---------------------------------------------------------------------------------------------
def test_tiny_ddp_is_two_cpu_processes():
    cfg = config.load(REPO / "configs" / "tiny-ddp.yaml")
    assert cfg.distributed.world_size == 2 and cfg.distributed.strategy == "ddp"
    assert _cfg().distributed.world_size == 1  # the default stays one process


@pytest.mark.parametrize("overrides, field", [
    (["distributed.nproc_per_node=3"], "train.batch_size / train.grad_accum_steps = 8"),
    (["distributed.nnodes=2"], "distributed.rdzv_endpoint"),
    (["distributed.nnodes=2", "distributed.rdzv_endpoint=node0"], "is not host:port"),
    (["distributed.node_rank=1"], "distributed.node_rank (1) must be below"),
    (["distributed.offload_optimizer=true", "distributed.strategy=fsdp2"], "deepspeed_zero2"),
    (["distributed.strategy=zero"], "distributed.strategy"),
])
def test_inconsistent_distributed_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        _cfg(*overrides)


# -- torchrun -------------------------------------------------------------------------------------------
def test_torchrun_command_single_node_is_standalone():
    from memfit.distributed.launch import torchrun_command

    cmd = torchrun_command(_cfg("distributed.nproc_per_node=2"), Path("/j/job.json"), python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and "--max-restarts=0" in cmd
    assert cmd[-3:] == ["-m", "memfit.distributed.worker", "/j/job.json"]


def test_torchrun_command_multi_node_uses_the_rendezvous():
    from memfit.distributed.launch import torchrun_command

    cfg = _cfg("distributed.nproc_per_node=8", "distributed.nnodes=4", "distributed.node_rank=2",
               "distributed.rdzv_endpoint=10.0.0.1:29400", "train.batch_size=64", "train.grad_accum_steps=2")
    cmd = torchrun_command(cfg, Path("job.json"), python="py")
    assert "--standalone" not in cmd
    for arg in ("--nnodes=4", "--node-rank=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
                "--rdzv-id=tiny"):
        assert arg in cmd


# -- DeepSpeed ------------------------------------------------------------------------------------------
def test_deepspeed_config_follows_the_plan():
    from memfit.distributed.ds_config import deepspeed_config

    c = deepspeed_config(stage=3, world_size=8, batch_size=64, grad_accum_steps=2, precision="bf16-mixed",
                         max_grad_norm=1.0, lr=2e-5, weight_decay=0.1, policy="full", num_layers=32,
                         offload_optimizer=True, hidden_size=4096)
    # DeepSpeed checks train_batch_size == micro x accumulation x world size.
    assert c["train_batch_size"] == 64 and c["train_micro_batch_size_per_gpu"] == 4
    assert c["gradient_accumulation_steps"] == 2 and c["gradient_clipping"] == 1.0
    assert c["bf16"]["enabled"] and not c["fp16"]["enabled"]
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu"
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    # Buckets sized to the model (transformers' "auto"), not DeepSpeed's 5e8 elements (4 GB a ZeRO-2 rank in fp32).
    assert z["reduce_bucket_size"] == 4096**2 and z["stage3_prefetch_bucket_size"] == int(0.9 * 4096**2)
    assert z["stage3_param_persistence_threshold"] == 40960
    assert c["optimizer"]["params"]["lr"] == 2e-5 and c["optimizer"]["params"]["torch_adam"] is True
    assert c["activation_checkpointing"]["number_checkpoints"] == 32
    json.dumps(c)  # it is written as the JSON DeepSpeed reads
    z2 = deepspeed_config(stage=2, world_size=2, batch_size=8, grad_accum_steps=1, precision="fp16-mixed",
                          max_grad_norm=None, lr=1e-3, weight_decay=0.0, policy="none", num_layers=2)
    assert z2["fp16"]["enabled"] and z2["gradient_clipping"] == 0.0 and "offload_optimizer" not in \
        z2["zero_optimization"]


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 1}, "stage must be 2 or 3"),
    ({"batch_size": 10}, "multiple of"),
    ({"precision": "bf16-true"}, "bf16-mixed"),
])
def test_deepspeed_config_rejects_what_deepspeed_would(kwargs, match):
    from memfit.distributed.ds_config import deepspeed_config

    args = {"stage": 2, "world_size": 2, "batch_size": 8, "grad_accum_steps": 2, "precision": "fp32",
            "max_grad_norm": 1.0, "lr": 1e-3, "weight_decay": 0.0, "policy": "none", "num_layers": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        deepspeed_config(**args)


def test_missing_deepspeed_says_how_to_install_it():
    from memfit.distributed.ds_config import import_deepspeed

    try:
        import deepspeed
    except ImportError:
        with pytest.raises(ConfigError, match=r"memfit\[deepspeed\]"):
            import_deepspeed()
    else:
        assert import_deepspeed() is deepspeed  # the installed package itself, not a stand-in


# -- planning -------------------------------------------------------------------------------------------
def _probe(peak: int, budget: int | None, n_params: int = 1000):
    from memfit.reports import ProbeReport

    return ProbeReport(environment={}, model_source="preset:tiny-llama", n_params=n_params, baseline={
        "peak_bytes": peak, "budget_bytes": budget, "breakdown": {"activation": 3000, "temp": 1000}})


def _plan():
    from memfit.reports import PlanReport

    return PlanReport(policy="none", every_k=2, precision="fp32", micro_batch_size=8, grad_accum_steps=2,
                      reason="r", description="d")


def test_auto_strategy_is_ddp_when_a_replica_fits_else_fsdp2():
    from memfit.distributed.planning import plan_distributed

    cfg = _cfg("distributed.nproc_per_node=2", "model.num_layers=8")
    roomy = plan_distributed(cfg, _probe(20_000, 10**9), _plan())
    assert roomy.strategy == "ddp" and roomy.world_size == 2 and roomy.sharding["total"] == 16_000 + 4000 + 4000
    # 4 + 4 + 8 kB of state, 4 kB of activations, 4 kB of DDP buckets: a replica needs 24 kB. Sharded: 2 + 2 + 4 +
    # 4 kB, plus three 0.5 kB blocks of weights (computing, prefetched, the last kept after forward) and two of
    # gradients (unsharded, and the reduce-scatter's input): 14.5 kB.
    tight = plan_distributed(cfg, _probe(20_000, 21_000), _plan())
    assert tight.strategy == "fsdp2" and tight.sharding["params"] == 2000 and tight.sharding["total"] == 14_500
    assert "over the 21.00 kB budget" in tight.reason and tight.reason.endswith("fsdp2")
    one = plan_distributed(_cfg(), _probe(20_000, None), _plan())
    assert one.strategy == "single" and one.world_size == 1


def _dpo(monkeypatch, *overrides: str, passes: float | None = 0.5):
    """The DPO config on two ranks, its run going over its pairs `passes` times (None: the data unread)."""
    import memfit.memory.planner.pair_length as pair_length

    monkeypatch.setattr(pair_length, "planned_coverage", lambda cfg: passes)
    return config.load(REPO / "configs" / "dpo-tiny.yaml", ["distributed.nproc_per_node=2", "model.num_layers=8",
                                                             *overrides])


def test_auto_strategy_counts_dpos_reference_copy_on_a_replica_and_shards_when_it_does_not_fit(monkeypatch):
    from memfit.distributed.planning import plan_distributed

    # 4 + 4 + 8 kB of state, 4 kB of activations and 4 kB of buckets: an SFT replica needs 24 kB and fits 26 kB.
    assert plan_distributed(_cfg("distributed.nproc_per_node=2"), _probe(20_000, 26_000), _plan()).strategy == "ddp"
    # Full fine-tuning DPO below one pass over its pairs keeps a frozen copy (4 kB more) on every replica: 28 kB.
    roomy = plan_distributed(_dpo(monkeypatch), _probe(20_000, 10**9), _plan())
    assert roomy.strategy == "ddp" and roomy.sharding["reference"] == 4000 and roomy.sharding["total"] == 28_000
    tight = plan_distributed(_dpo(monkeypatch), _probe(20_000, 26_000), _plan())
    assert tight.strategy == "fsdp2", tight.reason
    # FSDP2 splits the weights, so the ranks precompute the reference instead: no copy, 14.5 kB.
    assert tight.sharding["reference"] == 0 and tight.sharding["total"] == 14_500
    assert "DPO reference copy's 4.00 kB" in tight.reason and "precomputed" in tight.reason
    # Over one pass, auto precomputes on any strategy: the replica is the SFT one again.
    assert plan_distributed(_dpo(monkeypatch, passes=2.0), _probe(20_000, 26_000), _plan()).strategy == "ddp"


def test_a_configured_reference_copy_keeps_a_replica_and_names_the_way_out(monkeypatch):
    from memfit.distributed.planning import plan_distributed

    plan = plan_distributed(_dpo(monkeypatch, "dpo.reference=copy"), _probe(20_000, 26_000), _plan())
    assert plan.strategy == "ddp" and plan.sharding["total"] == 28_000  # fsdp2 cannot hold a copy
    assert "over the 26.00 kB budget" in plan.reason and "dpo.reference to precompute" in plan.reason


def test_lora_dpo_ranks_count_the_adapters_as_trained_and_no_copy(monkeypatch):
    from memfit.distributed.planning import plan_distributed

    lora = _plan().model_copy(update={"lora": True, "trainable_params": 100, "weight_bytes": 4400})
    plan = plan_distributed(_dpo(monkeypatch, "distributed.strategy=ddp"), _probe(20_000, 10**9), lora)
    s = plan.sharding  # the adapters' gradients, moments and buckets only; adapter_off is the reference: no copy
    assert (s["params"], s["grads"], s["optim"], s["reference"], s["transient"]) == (4400, 400, 800, 0, 400)
    assert s["total"] == 4400 + 400 + 800 + 4000 + 400


def test_fp16_with_fsdp2_is_refused_with_the_alternative():
    from memfit.distributed.planning import plan_distributed

    cfg = _cfg("distributed.nproc_per_node=2", "distributed.strategy=fsdp2")
    with pytest.raises(ConfigError, match="bf16-mixed"):
        plan_distributed(cfg, _probe(1, None), _plan().model_copy(update={"precision": "fp16-mixed"}))


# -- how a failed run comes back ------------------------------------------------------------------------
def _job_dir(tmp_path: Path) -> Path:
    (tmp_path / "errors").mkdir()
    return tmp_path


def test_outcome_reads_the_report_or_raises_the_first_rank_error(tmp_path):
    from memfit.distributed.launch import outcome

    cfg = _cfg("distributed.nproc_per_node=2")
    jdir = _job_dir(tmp_path)
    report = {"mlflow_run_id": "r", "start_step": 0, "steps": 8, "resumed_from": None, "preempted": False,
              "initial_val_loss": 5.0, "final_train_loss": 4.0, "tokens_per_s": 1.0, "peak_memory_bytes": 1,
              "last_checkpoint_uri": "x", "world_size": 2, "strategy": "ddp"}
    (jdir / "report.json").write_text(json.dumps(report))
    assert outcome(cfg, jdir, 0).steps == 8
    (jdir / "report.json").write_text(json.dumps({**report, "preempted": True, "steps": 5}))
    with pytest.raises(Preempted, match="step 5"):
        outcome(cfg, jdir, 1)  # torchrun says 1 when ranks exit 75; the report says why
    (jdir / "report.json").unlink()
    (jdir / "errors" / "rank-00000.json").write_text(json.dumps(
        {"rank": 0, "type": "RuntimeError", "message": "Connection closed by peer", "time": 2.0}))
    (jdir / "errors" / "rank-00001.json").write_text(json.dumps(
        {"rank": 1, "type": "RuntimeError", "message": "CUDA out of memory", "time": 1.0, "traceback": "tb"}))
    with pytest.raises(DistributedError, match="rank 1 of 2 failed: CUDA out of memory"):
        outcome(cfg, jdir, 1)
    (jdir / "errors" / "rank-00001.json").write_text(json.dumps(
        {"rank": 1, "type": "DataError", "message": "data.path: x not found", "time": 1.0}))
    with pytest.raises(DataError, match="data.path"):  # memfit's own errors keep their class (and exit code)
        outcome(cfg, jdir, 1)
    for f in (jdir / "errors").iterdir():
        f.unlink()
    with pytest.raises(DistributedError, match="no rank reported why"):
        outcome(cfg, jdir, -9)
    # This node forwarded a stop (SIGTERM, spot notice) and the ranks died before saving (still starting up):
    # a preemption to rerun, not a crash.
    with pytest.raises(Preempted, match=r"preempted \(SIGTERM\) before the ranks saved") as info:
        outcome(cfg, jdir, -15, stop_reason="SIGTERM")
    assert info.value.exit_code == 75


def test_planned_micro_batches_split_evenly_over_the_ranks():
    from memfit.memory.planner.search import _micro_batches

    one = _cfg("train.batch_size=16", "train.grad_accum_steps=1", "memory.allow_smaller_micro_batch=true")
    assert _micro_batches(one) == [16, 8, 4, 2, 1]
    four = _cfg("train.batch_size=16", "train.grad_accum_steps=1", "memory.allow_smaller_micro_batch=true",
               "distributed.nproc_per_node=4")
    assert _micro_batches(four) == [16, 8, 4]  # never 2 or 1: four ranks could not share them


# -- DCP files ------------------------------------------------------------------------------------------
def test_dcp_index_with_a_planted_object_is_refused(tmp_path):
    from memfit.checkpoints.reader import read_metadata

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "dcp-metadata"
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="refuses to load"):
        read_metadata(path)
    assert not (tmp_path / "pwned").exists()


def test_single_process_dcp_round_trip_and_lazy_consolidation(tmp_path):
    import torch.distributed.checkpoint as dcp

    from memfit.checkpoints.format import METADATA_FILE
    from memfit.checkpoints.reader import consolidate, indexed_optimizer_state, read_metadata

    model = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    optim = {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.5)}}
    dcp.save({"model": model, "optim": optim}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    os.replace(tmp_path / ".metadata", tmp_path / METADATA_FILE)
    read_metadata(tmp_path / METADATA_FILE)  # DCP's own index passes the allow-list
    only_model = consolidate(tmp_path, {"model"})
    assert set(only_model) == {"model"} and torch.equal(only_model["model"]["w"], model["w"])
    full = consolidate(tmp_path)
    groups = [{"params": ["w"], "lr": 1.0, "betas": [0.9, 0.95]}, {"params": ["b"], "lr": 1.0}]
    positional = indexed_optimizer_state(full["optim"], groups)
    assert set(positional["state"]) == {0} and positional["param_groups"][1]["params"] == [1]
    assert positional["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(positional["state"][0]["exp_avg"], optim["w"]["exp_avg"])


# -- multi-node entry point ---------------------------------------------------------------------------
def test_launch_node_needs_more_than_one_process():
    from memfit.phases import launch_node

    with pytest.raises(ConfigError, match="launch-node is for multi-process runs"):
        launch_node(_cfg())
