"""A new SQLite MLflow store copied from the cached empty one: same schema as MLflow's own, never over a store."""

from __future__ import annotations

import os
import sqlite3

import pytest

from memfit.files import CACHE_ENV
from memfit.tracking import sqlite_seed
from memfit.tracking.sqlite_seed import seed_sqlite_store

pytestmark = pytest.mark.unit


def _schema(db) -> list[tuple[str, str, list[str]]]:
    """Every table and index with the clauses of its SQL. As a set: alembic's table rebuilds write the CHECK
    constraints in an order that varies between processes (MLflow's own stores differ there too)."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        return sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                      for kind, name, sql in rows)


def _rows(db, table: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return sorted(con.execute(f"SELECT * FROM {table}"))  # noqa: S608 - a table name of this test's


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache folder holding the template, built once for the module's tests."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(folder))
        assert seed_sqlite_store(f"sqlite:///{folder / 'first.db'}") is True
    return folder


@pytest.fixture
def built_cache(built, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(built))
    return built


def test_a_seeded_store_is_the_store_mlflow_creates(tmp_path, built_cache, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default experiment keeps its artifacts in ./mlruns of the cwd
    made, seeded = tmp_path / "made.db", tmp_path / "seeded.db"
    MlflowClient(f"sqlite:///{made}").search_experiments()  # MLflow migrates an empty file itself
    assert seed_sqlite_store(f"sqlite:///{seeded}") is True
    assert sqlite_seed.template_path().is_file() and sqlite_seed.template_path().parent.parent == built_cache

    assert _schema(seeded) == _schema(made)  # every table, index and column, at the same alembic head
    assert _rows(seeded, "alembic_version") == _rows(made, "alembic_version")
    client = MlflowClient(f"sqlite:///{seeded}")
    exp = client.get_experiment("0")  # the default experiment: MLflow creates it on first open, here
    assert exp.name == "Default" and exp.artifact_location == MlflowClient(f"sqlite:///{made}").get_experiment(
        "0").artifact_location
    run = client.create_run(client.create_experiment("seeded"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 1.5)]


def test_an_existing_store_is_never_replaced(tmp_path, built_cache):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"someone's store")
    assert seed_sqlite_store(f"sqlite:///{db}") is False
    assert db.read_bytes() == b"someone's store"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # no temporary copy left beside it


def test_the_template_is_built_once_then_copied(tmp_path, built_cache, monkeypatch):
    template = sqlite_seed.template_path()  # built by the module fixture's first seed
    before = template.stat().st_mtime_ns

    def no_second_build(path):
        raise AssertionError(f"template built again at {path}")

    monkeypatch.setattr(sqlite_seed, "_build_template", no_second_build)
    for name in ("a.db", "b.db"):
        assert seed_sqlite_store(f"sqlite:///{tmp_path / name}")
        assert (tmp_path / name).read_bytes() == template.read_bytes()
    assert template.stat().st_mtime_ns == before


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "sqlite:///:memory:", "sqlite://", "file:///tmp/mlruns"])
def test_other_stores_are_left_to_mlflow(uri, cache):
    assert seed_sqlite_store(uri) is False
    assert not cache.exists()  # not even the template is built for them


def test_a_cache_that_cannot_be_written_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # the cache's folder cannot be created under a file
    db = tmp_path / "mlflow.db"
    assert seed_sqlite_store(f"sqlite:///{db}") is False
    assert not db.exists() and sorted(os.listdir(tmp_path)) == ["not-a-folder"]
    assert MlflowClient(f"sqlite:///{db}").get_experiment("0").name == "Default"  # MLflow migrates it, as before
