"""Training checkpoints on S3 (moto over HTTP): faults ridden out or failing loudly, corruption, the watcher."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from fixtures.faults import FakeMetadata, FaultProxy

from memfit import phases, run_context
from memfit.checkpoints import MANIFEST, CheckpointManager, take_snapshot
from memfit.errors import CheckpointError, Preempted
from memfit.reports import PlanReport
from memfit.storage.s3 import S3Store
from memfit.tracking.null import NullTracker

pytestmark = pytest.mark.integration


def _snapshot(step: int, value: float):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return take_snapshot(step, model.state_dict(), opt.state_dict(), {"torch": torch.get_rng_state()},
                         {"step": step}, "train: {}\n")


@pytest.fixture()
def proxy(s3_bucket, monkeypatch):
    """A fault-injecting proxy in front of moto; every boto3 client of the code under test goes through it."""
    endpoint, _bucket = s3_bucket
    p = FaultProxy(endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.url)
    yield p
    p.close()


def _manager(bucket: str, prefix: str, tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(S3Store(f"s3://{bucket}/{prefix}"), keep_last=3, staging_dir=tmp_path / "staging", **kw)


@pytest.mark.parametrize("fault", ["503", "reset", "down"])
def test_s3_faults_during_a_save_are_ridden_out(proxy, s3_bucket, tmp_path, fault):
    _endpoint, bucket = s3_bucket
    m = _manager(bucket, f"faults-{fault}", tmp_path, upload_attempts=3, retry_backoff_s=0.5)
    m.save(_snapshot(1, 1.0))
    start = time.monotonic()
    if fault == "down":
        proxy.set_mode("down")  # connection refused for 2 s, longer than a few botocore retries
        threading.Timer(2.0, proxy.set_mode, args=("pass",)).start()
    else:
        proxy.set_mode(fault, count=2)
    m.save(_snapshot(2, 2.0), blocking=False)
    m.close()
    if fault == "down":
        assert time.monotonic() - start >= 1.9, "committed while the endpoint was down?"
    else:
        assert proxy.faulted == 2, "the fault was never hit"
    loaded = m.latest(tmp_path / "dl")
    assert loaded.step == 2 and torch.all(loaded.model_state["weight"] == 2.0)


def test_s3_down_for_good_fails_the_save_loudly_and_leaves_no_complete_checkpoint(proxy, s3_bucket, tmp_path,
                                                                                  monkeypatch):
    _endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the standard AWS variable: short, for the test
    m = _manager(bucket, "down-for-good", tmp_path, upload_attempts=2, retry_backoff_s=0.2)
    m.save(_snapshot(1, 1.0))
    proxy.set_mode("down")
    m.save(_snapshot(2, 2.0), blocking=False)
    with pytest.raises(CheckpointError) as info:
        m.wait()
    msg = str(info.value)
    assert f"step 2 could not be saved to s3://{bucket}/down-for-good/step-00000002 (2 attempt(s))" in msg
    assert f"cannot reach {proxy.url}" in msg
    proxy.set_mode("pass")
    assert [i.step for i in m.list()] == [1]
    assert not m.store.exists(f"step-00000002/{MANIFEST}")
    m.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_on_s3_falls_back_with_a_warning(s3_bucket, s3_client, tmp_path, caplog, damage):
    _endpoint, bucket = s3_bucket
    m = _manager(bucket, f"corrupt-{damage}", tmp_path)
    m.save(_snapshot(2, 2.0))
    m.save(_snapshot(4, 4.0))
    key = f"corrupt-{damage}/step-00000004/model.safetensors"
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) - 100]
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoints"):
        loaded = m.latest(tmp_path / "dl")
    assert loaded.step == 2 and torch.all(loaded.model_state["weight"] == 2.0)
    assert "skipping training checkpoint" in caplog.text and "step-00000004" in caplog.text
    assert ("sha256" if damage == "flip" else "bytes, manifest says") in caplog.text

    from typer.testing import CliRunner

    from memfit.cli import app

    res = CliRunner().invoke(app, ["checkpoints", "verify", f"s3://{bucket}/corrupt-{damage}", "--json"])
    assert res.exit_code == 1
    rows = {r["step"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])["checkpoints"]}
    assert rows[2]["status"] == "verified" and rows[4]["status"] == "corrupt"
    m.close()


class _Evil:
    def __reduce__(self):
        return (Path("/tmp/memfit-pwned-s3").touch, ())


def test_pickle_planted_on_s3_is_never_unpickled(s3_bucket, s3_client, tmp_path):
    _endpoint, bucket = s3_bucket
    m = _manager(bucket, "planted", tmp_path)
    m.save(_snapshot(3, 3.0))
    evil = pickle.dumps({"state": _Evil()})
    s3_client.put_object(Bucket=bucket, Key="planted/step-00000003/optimizer.pt", Body=evil)
    # Re-sign the manifest, as an attacker with write access would: only the loader's refusal can stop it.
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=f"planted/step-00000003/{MANIFEST}")["Body"].read())
    manifest["files"]["optimizer.pt"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    s3_client.put_object(Bucket=bucket, Key=f"planted/step-00000003/{MANIFEST}", Body=json.dumps(manifest).encode())
    Path("/tmp/memfit-pwned-s3").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="unreadable training checkpoint"):
        m.load(m.list()[-1], tmp_path / "dl")
    assert m.latest(tmp_path / "dl2") is None
    assert not Path("/tmp/memfit-pwned-s3").exists()
    m.close()


# -- whole training runs (in process, no Prefect) ----------------------------------------------------------
def _train(cfg):
    # Phases 4 and 3 only: the baseline probe (phase 1) is not what these tests are about.
    t = cfg.train
    plan = PlanReport(policy="none", every_k=2, precision=t.precision, micro_batch_size=t.micro_batch_size,
                      grad_accum_steps=t.grad_accum_steps, reason="test", description="none")
    return phases.train(cfg, plan, phases.recover_training_checkpoint(cfg))


def _at_step(monkeypatch, at: int, action) -> None:
    original = NullTracker.log_metrics

    def hook(self, metrics, step):  # noqa: F811 - called with step= by keyword
        original(self, metrics, step)
        if step == at and "loss" in metrics:
            action()

    monkeypatch.setattr(NullTracker, "log_metrics", hook)



def _when_saving(monkeypatch, step: int, action) -> None:
    """Run `action` as the background writer starts uploading `step`: the fault hits that save, whatever
    earlier uploads are still doing on a slow machine."""
    original = CheckpointManager._stage

    def hooked(self, snap):
        if snap.step == step:
            action()
        return original(self, snap)

    monkeypatch.setattr(CheckpointManager, "_stage", hooked)

@pytest.fixture(scope="module")
def shared_work(tmp_path_factory) -> Path:
    """One run.work_dir for the training tests here: the preset model and tokenizer are built once."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture()
def small(tiny_config, shared_work):
    def make(**extra):
        return tiny_config(**{"tracking.backend": "null", "train.max_steps": 8, "checkpoint.every_steps": 2,
                              "data.synthetic_docs": 300, "run.work_dir": shared_work, **extra})

    return make


def test_training_rides_out_an_s3_outage(proxy, s3_bucket, s3_client, small, tmp_path, monkeypatch, caplog):
    _endpoint, bucket = s3_bucket
    # botocore's own retries give up fast here, so memfit's save-level retries (0.5+1+2+4 s) ride it out.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    cfg = small(**{"checkpoint.uri": f"s3://{bucket}/outage", "checkpoint.upload_attempts": 5,
                   "checkpoint.retry_backoff_seconds": 0.5})

    def outage():
        proxy.set_mode("down")
        threading.Timer(2.5, proxy.set_mode, args=("pass",)).start()

    _when_saving(monkeypatch, 4, outage)
    with caplog.at_level(logging.INFO, logger="memfit.checkpoints"):
        result = _train(cfg)
    assert result.steps == 8
    # The step-4 save started inside the 2.5 s outage and committed only after it; training went on.
    took = re.search(r"step 4 committed to \S+ \((\d+\.\d+) s", caplog.text)
    assert took and float(took.group(1)) >= 1.5, caplog.text[-2000:]
    m = run_context.checkpoint_manager(cfg)
    assert [i.step for i in m.list()] == [6, 8]
    assert m.latest(tmp_path / "dl").step == 8
    assert result.checkpoint_stats["saves"] == 4 and result.checkpoint_stats["skipped"] == 0


def test_training_fails_loudly_when_s3_stays_down(proxy, s3_bucket, s3_client, small, tmp_path, monkeypatch):
    _endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    cfg = small(**{"checkpoint.uri": f"s3://{bucket}/stays-down", "checkpoint.upload_attempts": 1})
    _when_saving(monkeypatch, 4, lambda: proxy.set_mode("down"))
    with pytest.raises(CheckpointError, match="step 4 could not be saved") as info:
        _train(cfg)
    assert "cannot reach" in str(info.value)
    proxy.set_mode("pass")
    m = run_context.checkpoint_manager(cfg)
    assert [i.step for i in m.list()] == [2]  # step 4 never became a checkpoint
    assert m.latest(tmp_path / "dl").step == 2


def test_spot_notice_from_the_environment_preempts_training(small, monkeypatch):
    imds = FakeMetadata()
    try:
        # What infra/k8s/spot-work-pool.json sets; the config leaves checkpoint.spot.enabled null.
        monkeypatch.setenv("MEMFIT_SPOT_WATCHER", "true")
        monkeypatch.setenv("MEMFIT_SPOT_METADATA_URL", imds.url)
        cfg = small(**{"train.max_steps": 30, "checkpoint.every_steps": 100, "checkpoint.spot.poll_seconds": 0.05})
        notice = {"action": "terminate", "time": "2026-11-30T12:02:00Z"}
        _at_step(monkeypatch, 3, lambda: setattr(imds, "instance_action", notice))
        with pytest.raises(Preempted, match="spot interruption notice: terminate at 2026-11-30T12:02:00Z") as info:
            _train(cfg)
        assert info.value.exit_code == 75
        steps = [i.step for i in run_context.checkpoint_manager(cfg).list()]
        assert len(steps) == 1 and 3 <= steps[0] < 30  # saved soon after the notice, not at the end
        assert any(p.endswith("instance-action") for _, p, _ in imds.requests)
    finally:
        imds.close()


def test_rebalance_recommendation_saves_a_checkpoint_and_training_goes_on(small, monkeypatch):
    imds = FakeMetadata()
    try:
        cfg = small(**{"checkpoint.every_steps": 100, "checkpoint.keep_last": 5, "checkpoint.spot.enabled": True,
                       "checkpoint.spot.metadata_url": imds.url, "checkpoint.spot.poll_seconds": 0.05})
        _at_step(monkeypatch, 3, lambda: setattr(imds, "rebalance", {"noticeTime": "2026-11-30T11:58:00Z"}))
        result = _train(cfg)
        assert result.steps == 8 and not result.preempted
        steps = [i.step for i in run_context.checkpoint_manager(cfg).list()]
        assert len(steps) == 2 and 3 <= steps[0] < 8 and steps[1] == 8
    finally:
        imds.close()


def test_checkpoint_endpoint_and_region_come_from_the_config(s3_bucket, monkeypatch, tmp_path):
    from memfit import config
    from memfit.errors import ConfigError

    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # wrong on purpose: the config wins
    cfg = config.load(None, [f"checkpoint.uri=s3://{bucket}/cfg", f"checkpoint.endpoint_url={endpoint}",
                             "checkpoint.region=eu-west-1", f"run.work_dir={tmp_path}"])
    store = run_context.open_checkpoint_store(cfg)
    store.check_writable()
    assert store.endpoint == endpoint and store.client.meta.region_name == "eu-west-1"
    local = config.load(None, [f"checkpoint.uri={tmp_path / 'ckpt'}", f"checkpoint.endpoint_url={endpoint}"])
    with pytest.raises(ConfigError, match="checkpoint.endpoint_url only applies to s3:// uris"):
        run_context.open_checkpoint_store(local)
