"""Config tree: defaults, YAML diffs, --set overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit import config
from memfit.errors import ConfigError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

def test_every_field_is_documented_and_every_section_forbids_unknown_keys():
    """The tree is the Prefect form and the docs: each field has a description, no section takes extra keys."""
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str):
        assert model.model_config.get("extra") == "forbid", f"{prefix or 'root'} accepts unknown keys"
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from walk(sub, key + ".")
            else:
                yield key, field.description

    fields = dict(walk(config.MemfitConfig, ""))
    assert len(fields) > 60
    undocumented = sorted(k for k, doc in fields.items() if not doc or len(doc) < 10)
    assert not undocumented, undocumented
    assert set(fields) == set(config.MemfitConfig().flat())  # flat() (MLflow params) covers the whole tree


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path: Path):
    cfg = config.load(path)
    # Each file changes something, and what it says is what loads (a diff from defaults, not a no-op).
    import yaml

    diff = yaml.safe_load(path.read_text()) or {}
    assert diff, f"{path.name} is empty"
    flat, default = cfg.flat(), config.MemfitConfig().flat()
    assert any(flat[k] != default[k] for k in flat), f"{path.name} changes nothing"
    for section, values in diff.items():
        for key, value in (values or {}).items():
            if not isinstance(value, dict):
                assert flat[f"{section}.{key}"] == value, (path.name, section, key)
    # A shipped YAML is a diff from defaults: it must not restate the whole tree.
    assert len(path.read_text().splitlines()) < 80


def test_overrides_parse_yaml_scalars(tmp_path):
    cfg = config.load(REPO / "configs" / "tiny.yaml",
                      ["train.max_steps=7", "train.lr=1e-3", "memory.budget_gb=0.5", "export.onnx=false",
                       "model.name_or_path=/some/folder"])
    assert cfg.train.max_steps == 7 and cfg.train.lr == 1e-3
    assert cfg.memory.budget_gb == 0.5 and cfg.export.onnx is False
    assert cfg.model.name_or_path == "/some/folder"


def test_unknown_key_names_the_dotted_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        config.load(p)
    assert "train.max_stepz" in str(e.value) and str(p) in str(e.value)
    assert "unknown key" in str(e.value)


@pytest.mark.parametrize("override, field", [
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.lr=-1", "train.lr"),
    ("memory.policy=sometimes", "memory.policy"),
    ("data.seq_len=2", "data.seq_len"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        config.load(None, [override])
    assert field in str(e.value)


def test_accumulation_must_divide_the_batch():
    with pytest.raises(ConfigError) as e:
        config.load(None, ["train.batch_size=10", "train.grad_accum_steps=3"])
    assert "train.grad_accum_steps" in str(e.value) and "train.batch_size" in str(e.value)
    assert config.load(None, ["train.batch_size=12", "train.grad_accum_steps=3"]).train.micro_batch_size == 4


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        config.load(top)


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        config.load(None, ["train.max_steps"])


def test_tracking_uri_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert config.TrackingConfig().resolved_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert config.TrackingConfig().resolved_uri() == "http://127.0.0.1:5000"
    assert config.TrackingConfig(uri="sqlite:///x.db").resolved_uri() == "sqlite:///x.db"


def test_yaml_round_trip():
    cfg = config.load(REPO / "configs" / "tiny.yaml")
    import yaml

    again = config.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_checkpoint_s3_and_spot_settings():
    cfg = config.load(REPO / "configs" / "tiny.yaml", [
        "checkpoint.uri=s3://bkt/run", "checkpoint.endpoint_url=http://minio:9000", "checkpoint.region=eu-west-1",
        "checkpoint.on_busy=skip", "checkpoint.spot.enabled=true", "checkpoint.spot.poll_seconds=2"])
    ck = cfg.checkpoint
    assert (ck.endpoint_url, ck.region, ck.on_busy, ck.spot.enabled, ck.spot.poll_seconds) == (
        "http://minio:9000", "eu-west-1", "skip", True, 2.0)
    # Unset by default: the environment (MEMFIT_SPOT_WATCHER) decides, and it is off unless set.
    assert config.MemfitConfig().checkpoint.spot.enabled is None
    with pytest.raises(ConfigError, match="checkpoint.on_busy"):
        config.load(None, ["checkpoint.on_busy=sometimes"])
    with pytest.raises(ConfigError, match="checkpoint.spot.metadata_url"):
        config.load(None, ["checkpoint.spot.metadata_url=metadata.internal/latest"])


def test_credentials_in_the_endpoint_url_are_refused_without_echo():
    with pytest.raises(ConfigError) as e:
        config.from_dict({"checkpoint": {"endpoint_url": "http://AKIA:hunter2@minio:9000"}})
    assert "checkpoint.endpoint_url" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)
    assert "hunter2" not in str(e.value)
