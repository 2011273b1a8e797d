"""A new SQLite MLflow store starts as a copy of an empty migrated one, built once per MLflow version, not per run."""

# MLflow creates a SQLite store by running its whole alembic history (≈ 50 migrations): ≈ 1.5 CPU s and ≈ 2 s on 2
# cores, in every new work folder, test and fresh machine. The result is the same empty schema every time, so memfit
# builds it once into its cache (next to the ONNX graphs) and copies it in. MLflow then finds every table at its head
# revision, checks that, and creates the default experiment itself (its artifact root depends on where it runs, so the
# template holds no rows of that kind). Any failure leaves the store to MLflow, exactly as before.

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from memfit.files import atomic_path, cache_root, temporary_sibling

log = logging.getLogger("memfit.tracking")

SUBDIR = "mlflow-stores"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI; None for anything else (a server, :memory:)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).expanduser().absolute()


def _schema_key() -> str:
    """MLflow's version and its migration scripts' names: a store built by one fits only the same pair."""
    import mlflow
    import mlflow.store.db_migrations as migrations

    versions = Path(migrations.__file__).parent / "versions"
    names = sorted(p.name for p in versions.glob("*.py"))
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
    return f"{mlflow.__version__}-{digest}"


def template_path() -> Path:
    return cache_root() / SUBDIR / f"empty-{_schema_key()}.db"


def _build_template(path: Path) -> None:
    """MLflow's own migrations on an empty file, once; the file appears whole (renamed into place) or not at all."""
    from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        engine = create_sqlalchemy_engine(f"sqlite:///{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()


def seed_sqlite_store(uri: str) -> bool:
    """Copy the empty migrated store to where `uri` points, if nothing is there yet. True when it did.

    Never over an existing file: the copy is linked in under the final name, so a store another process created
    meanwhile wins and is left alone.
    """
    db = sqlite_path(uri)
    if db is None or db.exists() or not db.parent.is_dir():
        return False
    try:
        template = template_path()
        if not template.is_file():
            _build_template(template)
        tmp = temporary_sibling(db)
        try:
            shutil.copyfile(template, tmp)
            os.link(tmp, db)
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        return False
    except Exception as err:  # noqa: BLE001 - a faster start, never a reason to fail: MLflow migrates as before
        log.debug("no MLflow store template (%s): MLflow creates %s itself", err, db)
        return False
    return True


def open_client(uri: str) -> Any:
    """An MlflowClient on `uri`, as memfit opens a store first (tracker, start-up warm-up, retraining): a new SQLite
    store copied in before MLflow would migrate one."""
    from mlflow import MlflowClient

    seed_sqlite_store(uri)
    return MlflowClient(tracking_uri=uri)
