"""`memfit profile` on the tiny model, and training runs watched by the memory monitor against a budget."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests_support import tiny_overrides

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
SMALL = {"data.synthetic_docs": 400, "train.eval_batches": 1}


def _config(root: Path, **extra: object):
    from memfit import config

    return config.load(TINY, tiny_overrides(root, f"sqlite:///{root / 'mlflow.db'}", **{**SMALL, **extra}))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """`memfit profile --compare none,full --json --trace --mlflow-run new`, run once as a user would."""
    root = tmp_path_factory.mktemp("profile")
    out = root / "out"
    sets = [a for item in tiny_overrides(root, f"sqlite:///{root / 'mlflow.db'}", **SMALL) for a in ("--set", item)]
    proc = subprocess.run(
        [sys.executable, "-m", "memfit.cli", "profile", TINY, "--compare", "none,full", "--out", str(out), "--json",
         "--steps", "2", "--trace", "--mlflow-run", "new", *sets],
        cwd=root, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    return root, out, printed, json.loads((out / "profile.json").read_text())


def test_profile_writes_table_json_and_pngs(profiled):
    _, out, printed, doc = profiled
    for name in ("profile.json", "modules.md", "timeline_none.png", "timeline_full.png", "compare.png"):
        assert (out / name).stat().st_size > 0, name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "modules.md").read_text()
    assert "## policy `none`" in table and "## policy `full`" in table
    assert "| `model.layers.0` |" in table and "| `lm_head` |" in table
    assert printed["files"]["compare"] == str(out / "compare.png")
    none, full = doc["policies"]["none"], doc["policies"]["full"]
    assert full["peak_activation_bytes"] < none["peak_activation_bytes"] / 2
    assert printed["policies"]["full"]["peak_activation_bytes"] == full["peak_activation_bytes"]
    # The comparison chart's data: the full-recompute curve peaks lower, and its backward is longer.
    assert max(full["timeline"]["total"]) < max(none["timeline"]["total"])
    assert max(full["timeline"]["activations"]) < max(none["timeline"]["activations"])
    assert full["allocated_bytes"]["recompute"] > 0 == none["allocated_bytes"]["recompute"]
    assert full["events"] > none["events"]
    # Each timed step's time, and its computed tokens (plain blocks: every row full) over that time.
    cfg = _config(profiled[0])
    for s in (none, full):
        assert s["tokens_per_step"] == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
        assert len(s["step_times"]) == 1 and s["step_times"][0] == s["step_seconds"] > 0
        assert s["tokens_per_second"] == pytest.approx(s["tokens_per_step"] / s["step_seconds"])


def test_per_module_activations_add_up_to_an_independent_total(profiled):
    root, _, _, doc = profiled
    for s in doc["policies"].values():
        rows = s["modules"]
        assert sum(r["activation_bytes"] for r in rows) == s["activation_bytes_after_forward"]
        assert sum(r["params_bytes"] for r in rows) == s["after_forward"]["parameter"]
        assert {r["module"] for r in rows} >= {"model.layers.0", "model.layers.1", "model.embed_tokens"}
    # torch's own MemTracker, on the same model and micro-batch, counts the same activations after forward.
    from torch.distributed._tools.mem_tracker import MemTracker

    from memfit import run_context

    cfg = _config(root)
    model = run_context.load_inputs(cfg).model.train()
    batch = torch.randint(0, model.config.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(input_ids=batch, labels=batch)
    snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    theirs = next(v for k, v in snap.items() if str(getattr(k, "value", k)).lower() == "activation")
    ours = doc["policies"]["none"]["activation_bytes_after_forward"]
    assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)
    del out


def test_trace_and_mlflow_run(profiled):
    from mlflow import MlflowClient

    root, out, printed, _ = profiled
    trace = json.loads((out / "trace_full.json").read_text())
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(printed["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["memfit.profile.policies"] == "none,full"
    assert run.data.metrics["profile.full.peak_bytes"] < run.data.metrics["profile.none.peak_bytes"]
    assert run.data.metrics["profile.full.tokens_per_second"] == pytest.approx(printed["policies"]["full"][
        "tokens_per_second"])
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert {"profile/compare.png", "profile/profile.json", "profile/modules.md"} <= logged


def _train(cfg, policy: str = "none", resume=None):
    from memfit import phases
    from memfit.reports import PlanReport, ResumePoint

    plan = PlanReport(policy=policy, every_k=2, precision="fp32", micro_batch_size=cfg.train.micro_batch_size,
                      grad_accum_steps=cfg.train.grad_accum_steps, reason="test", description=policy)
    return phases.train(cfg, plan, resume or ResumePoint(checkpoint_uri=cfg.checkpoint.uri), None)


@pytest.mark.parametrize("headroom, warns", [(1.02 / 0.9, False), (0.95, True)], ids=["above", "below"])
def test_training_against_a_budget_from_the_profile(profiled, tmp_path, caplog, headroom, warns):
    """A budget just above the profiled peak (its warning line above the estimate): readings, no warning.
    One below the peak: exactly one warning, with the figures, as a log record and an MLflow tag."""
    from mlflow import MlflowClient

    estimate = profiled[3]["policies"]["none"]["peak_bytes"]
    cfg = _config(tmp_path, **{"tracking.uri": f"sqlite:///{profiled[0] / 'mlflow.db'}",  # tables exist already
                               "train.max_steps": 4, "monitor.every_steps": 2, "checkpoint.every_steps": 100,
                               "memory.budget_gb": estimate * headroom / 1e9})
    with caplog.at_level(logging.INFO, logger="memfit.memory"):
        report = _train(cfg)
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(report.mlflow_run_id)
    history = client.get_metric_history(run.info.run_id, "memory/peak_bytes")
    assert [m.step for m in history] == [1, 2, 4]
    for key in ("memory/allocated_bytes", "memory/reserved_bytes", "memory/rss_bytes", "memory/budget_fraction"):
        assert key in run.data.metrics, key
    warnings = [r for r in caplog.records if r.name == "memfit.memory" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in caplog.records if "memory at step" in r.getMessage()][-1].startswith(
        "memory at step 4: peak")
    assert report.steps == 4  # a warning never stops training
    if warns:
        assert len(warnings) == 1 and "of the" in warnings[0].getMessage()
        assert "memfit.memory.warning" in run.data.tags
        assert max(m.value for m in client.get_metric_history(run.info.run_id, "memory/budget_fraction")) > 1.0
    else:
        assert warnings == [] and "memfit.memory.warning" not in run.data.tags
        assert max(m.value for m in history) <= 0.9 * cfg.memory.budget_gb * 1e9


@pytest.fixture()
def captured_events(monkeypatch):
    """Prefect's own asserting events client (as prefect.testing's fixture), passing events to the server too."""
    from prefect.events.clients import AssertingPassthroughEventsClient
    from prefect.events.worker import EventsWorker

    worker = EventsWorker.instance(AssertingPassthroughEventsClient)
    monkeypatch.setattr(EventsWorker, "instance", lambda *_: worker)
    yield worker
    worker.drain()


def test_stop_at_the_limit_commits_a_checkpoint_and_exits_76(prefect_harness, captured_events, profiled, tmp_path):
    from typer.testing import CliRunner

    from memfit.checkpoints import CheckpointManager
    from memfit.cli import app
    from memfit.storage import open_store

    estimate = profiled[3]["policies"]["none"]["peak_bytes"]
    sets = tiny_overrides(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", **{
        **SMALL, "train.max_steps": 6, "monitor.every_steps": 2, "checkpoint.every_steps": 100,
        "memory.policy": "none", "memory.budget_gb": estimate * 0.97 / 1e9, "monitor.stop_at_fraction": 1.0})
    handlers = list(logging.getLogger().handlers)
    try:
        result = CliRunner().invoke(app, ["run", TINY, *[a for s in sets for a in ("--set", s)]])
    finally:  # the CLI's logging handler writes to the runner's stream, closed after invoke
        logging.getLogger().handlers[:] = handlers
    assert result.exit_code == 76, result.output[-3000:]
    last = result.output.strip().splitlines()[-1]  # the CLI's one-line error, after Prefect's own logs
    assert last.startswith("error: memory peak") and "monitor.stop_at_fraction=1.0" in last
    infos = CheckpointManager(open_store(str(tmp_path / "checkpoints"))).list()
    assert len(infos) == 1 and 1 <= infos[0].step < 6  # committed (it has a manifest) before the exit
    loaded = CheckpointManager(open_store(str(tmp_path / "checkpoints"))).latest(tmp_path / "verify")
    assert loaded is not None and loaded.step == infos[0].step  # every checksum verifies
    captured_events.drain()
    events = [e for e in captured_events._client.events if e.event.startswith("memfit.memory.")]
    assert [e.event for e in events] == ["memfit.memory.warning", "memfit.memory.limit"]
    limit = events[1]
    assert limit.payload["step"] == infos[0].step and limit.payload["peak_bytes"] > limit.payload["budget_bytes"]
    assert limit.resource.id == "memfit.run.tiny"
    assert any(r.role == "flow-run" for r in limit.related)

    # As the message says: the same run with full recompute resumes from that checkpoint and finishes.
    from memfit import config, phases

    again = config.load(TINY, [*sets, "memory.policy=full"])
    resume = phases.recover_training_checkpoint(again)
    assert resume.step == infos[0].step
    report = _train(again, policy="full", resume=resume)
    assert report.resumed_from == infos[0].step and report.steps == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda_writes_the_allocator_snapshot_html_and_trace(tmp_path):
    from memfit.profile import profile

    cfg = _config(tmp_path, **{"train.device": "cuda", "tracking.backend": "null"})
    result = profile(cfg, out_dir=tmp_path / "out", steps=2, compare=["none", "full"])
    files = result["files"]
    for name in ("none", "full"):
        assert Path(files[f"cuda_snapshot_{name}"]).stat().st_size > 0
        html = Path(files[f"cuda_memory_html_{name}"]).read_text()
        assert "<html" in html.lower() and "snapshot.pickle" in html
        trace = json.loads(Path(files[f"trace_{name}"]).read_text())
        assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])
    full, none = result["policies"]["full"], result["policies"]["none"]
    assert full["peak_activation_bytes"] < none["peak_activation_bytes"]
    assert result["workload"]["device"].startswith("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_runs_the_cpu_offloaded_optimizer_and_counts_its_state_off_the_gpu(tmp_path):
    pytest.importorskip("torchao")
    from memfit.profile import profile

    cfg = _config(tmp_path, **{"train.device": "cuda", "tracking.backend": "null",
                               "memory.optimizer": "adamw-cpu-offload"})
    result = profile(cfg, out_dir=tmp_path / "out", steps=2, compare=["full"])
    full = result["policies"]["full"]
    assert full["step_seconds"] > 0
    # The moments live in host memory: no module row books them on the GPU (torchao keeps tensors under 4096
    # values, norms and biases, on the device; the tiny model's projections are larger).
    assert sum(r["optimizer_bytes"] for r in full["modules"]) < sum(r["params_bytes"] for r in full["modules"])
