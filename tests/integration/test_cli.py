"""The command line as a user meets it: bad input gives one short error naming the field, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def memfit(*args: str, cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _outputs(tmp: Path) -> list[str]:
    from tests_support import tiny_overrides

    out = []
    for item in tiny_overrides(tmp):
        out += ["--set", item]
    return out


def _assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr[-2000:])


@pytest.mark.parametrize("args, needles", [
    (["--set", "train.max_stepz=3"], ["train.max_stepz", "unknown key"]),
    (["--set", "train.max_steps=ten"], ["train.max_steps"]),
    (["--set", "train.lr=-1"], ["train.lr"]),
    (["--set", "train.batch_size=10", "--set", "train.grad_accum_steps=3"], ["train.grad_accum_steps"]),
])
def test_config_errors(tmp_path, args, needles):
    _assert_clean_error(memfit("run", TINY, *args, cwd=tmp_path), *needles)


def test_missing_config_file(tmp_path):
    _assert_clean_error(memfit("run", "configs/nope.yaml", cwd=tmp_path), "configs/nope.yaml", "not found")


def test_missing_and_empty_data(tmp_path):
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--set", f"data.path={tmp_path / 'missing.txt'}", cwd=tmp_path)
    _assert_clean_error(proc, "data.path", "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    _assert_clean_error(memfit("probe", TINY, *_outputs(tmp_path), "--set", f"data.path={empty}", cwd=tmp_path),
                        "data.path")


@pytest.mark.parametrize("what", ["missing data", "empty data", "missing model"])
def test_run_rejects_bad_inputs_in_one_line_before_prefect_starts(tmp_path, what):
    """What the issue's user typed: `memfit run configs/tiny.yaml --set data.path=/nonexistent/data.txt`."""
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    setting, field = {"missing data": (f"data.path={tmp_path / 'nonexistent' / 'data.txt'}", "data.path"),
                      "empty data": (f"data.path={empty}", "data.path"),
                      "missing model": (f"model.name_or_path={tmp_path / 'nonexistent' / 'model'}",
                                        "model.name_or_path")}[what]
    started = time.monotonic()
    proc = memfit("run", TINY, "--set", setting, cwd=tmp_path, env={"PREFECT_HOME": str(tmp_path / "prefect")})
    took = time.monotonic() - started
    _assert_clean_error(proc, field)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) <= 3, lines
    assert lines[-1].startswith(f"error: {field}: ")
    assert not (tmp_path / "prefect").exists()  # refused before any Prefect server or database
    assert took < 10, f"{took:.1f} s"  # the bound: in seconds, not after the server's start-up


def test_unknown_model_path(tmp_path):
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--set", f"model.name_or_path={tmp_path / 'no-model'}",
                  cwd=tmp_path)
    _assert_clean_error(proc, "model.name_or_path", "no-model")


def test_seq_len_above_model_maximum(tmp_path):
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--set", "data.seq_len=1024", "--set",
                  "model.max_position_embeddings=256", cwd=tmp_path)
    # The preset takes max(max_position_embeddings, seq_len); a real model folder has a fixed maximum.
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = tmp_path / "model"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=32)).save_pretrained(hf)
    from memfit.models.loading import train_tokenizer

    train_tokenizer(["one two three four five six seven"] * 20, 300, hf)
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--set", f"model.name_or_path={hf}", cwd=tmp_path)
    _assert_clean_error(proc, "data.seq_len", "32")


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--set", f"export.dir={blocker / 'sub'}", cwd=tmp_path)
    _assert_clean_error(proc, "export.dir", str(blocker))
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("*.safetensors"))


def test_probe_json(tmp_path):
    proc = memfit("probe", TINY, *_outputs(tmp_path), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["baseline"]["peak_bytes"] > 0 and report["baseline"]["fits"] is True
    assert report["environment"]["libraries"]["transformers"]


def test_help_documents_every_command(tmp_path):
    """Every command the app registers is listed in --help with its one-line summary, and has its own --help."""
    from memfit.cli import app

    proc = memfit("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {ln.strip(" │").split()[0]: ln for ln in proc.stdout.splitlines() if ln.strip(" │")[:1].isalpha()}
    commands = {c.name or c.callback.__name__.replace("_", "-"): c for c in app.registered_commands}
    commands.update({g.name: g for g in app.registered_groups})
    assert {"run", "probe", "config", "checkpoints", "export", "resume", "serve"} <= set(commands)
    for name in commands:
        assert name in rows, f"`memfit --help` does not list {name}:\n{proc.stdout}"
        assert len(rows[name].split()) > 2, f"{name} has no summary in --help: {rows[name]!r}"
    sub = memfit("run", "--help", cwd=tmp_path)
    assert sub.returncode == 0 and "--set" in sub.stdout and "--json" in sub.stdout and "--debug" in sub.stdout
