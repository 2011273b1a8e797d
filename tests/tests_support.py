"""Helpers tests import directly (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def record_puts(monkeypatch: Any, store_cls: type) -> list[str]:
    """The keys a store class is asked to write (put_file and put_bytes), in order, for tests of upload order."""
    order: list[str] = []
    put_file, put_bytes = store_cls.put_file, store_cls.put_bytes

    def record_file(self: Any, path: Any, key: str, **kw: Any) -> Any:
        order.append(key)
        return put_file(self, path, key, **kw)

    def record_bytes(self: Any, key: str, data: bytes) -> Any:
        order.append(key)
        return put_bytes(self, key, data)

    monkeypatch.setattr(store_cls, "put_file", record_file)
    monkeypatch.setattr(store_cls, "put_bytes", record_bytes)
    return order


def cli_in_process(*args: str) -> Any:
    """`memfit ARGS` in this process (a subprocess costs seconds of imports a call): the same exit code, stdout
    and stderr (typer's CliRunner result). For commands whose process itself is not what a test checks."""
    from typer.testing import CliRunner

    from memfit.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def tiny_overrides(root: Path, mlflow_uri: str | None = None, **extra: object) -> list[str]:
    """--set overrides that keep a run's files under `root` and its size tiny."""
    items = {
        "run.work_dir": str(root / "work"),
        "checkpoint.uri": str(root / "checkpoints"),
        "export.dir": str(root / "export"),
        "tracking.uri": mlflow_uri or f"sqlite:///{root / 'mlflow.db'}",
        "tracking.experiment": "tests",
    }
    items.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def skip_without_gguf_tools() -> None:
    """Skip the calling test module without llama-cpp-python or llama.cpp's converter, with the reason (the converter's
    names the command that installs it: `memfit gguf-converter install`)."""
    import pytest

    pytest.importorskip("llama_cpp")
    from memfit.errors import ConfigError
    from memfit.release.gguf_converter import find

    try:
        find()
    except ConfigError as err:
        pytest.skip(str(err), allow_module_level=True)
