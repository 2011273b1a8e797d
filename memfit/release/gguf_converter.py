"""llama.cpp's own converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py), pinned with llama-cpp-python."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import ConfigError, ExportError

log = logging.getLogger("memfit.release")

# The converter travels with the llama.cpp that llama-cpp-python builds: its sdist vendors llama.cpp whole (the
# runtime memfit verifies with) and the converter kept in step with it. Pinned with the gguf extra (pyproject.toml).
PINNED = "0.3.36"
SDIST = f"llama_cpp_python-{PINNED}.tar.gz"
VENDOR = f"llama_cpp_python-{PINNED}/vendor/llama.cpp/"
# What the converters need of the vendored tree: the scripts, their conversion/ package and the matching gguf-py.
MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
LLAMA_CPP_HEAD = f"llama_cpp_python-{PINNED}/.git/modules/vendor/llama.cpp/HEAD"
STAMP = "memfit-converter.json"  # written last: a folder without it is not a finished install
ENV_DIR = "MEMFIT_GGUF_CONVERTER"  # a folder holding convert_hf_to_gguf.py (a llama.cpp checkout, or an install)
_REGISTER = re.compile(r"@ModelBase\.register\(([^)]*)\)")


@dataclass(frozen=True)
class Converter:
    """An installed converter: its folder, the llama-cpp-python sdist it came from, llama.cpp's commit."""

    dir: Path
    llama_cpp_python: str
    llama_cpp_commit: str
    sdist_sha256: str

    def record(self) -> dict[str, str]:
        """What an export's manifest says of the converter that wrote it."""
        return {"converter": "llama.cpp convert_hf_to_gguf.py", "llama_cpp_python": self.llama_cpp_python,
                "llama_cpp_commit": self.llama_cpp_commit, "sdist_sha256": self.sdist_sha256}


def default_dir() -> Path:
    """Beside the interpreter's packages (the venv, the image): installed with them, removed with them."""
    return Path(sys.prefix) / "share" / "memfit" / f"llama.cpp-converter-{PINNED}"


def _install_hint(where: Path) -> str:
    return (f"llama.cpp's converter is not installed at {where}: run `memfit gguf-converter install` (it takes the "
            f"converter from the pinned llama-cpp-python {PINNED} sdist), or set {ENV_DIR} to a llama.cpp checkout")


def find(configured: str | Path | None = None) -> Converter:
    """The converter to use: `configured` (export.gguf_converter), else $MEMFIT_GGUF_CONVERTER, else the default
    install; ConfigError in one line naming the folder and the command that installs it."""
    where = Path(configured or os.environ.get(ENV_DIR) or default_dir()).expanduser()
    if not (where / "convert_hf_to_gguf.py").is_file():
        raise ConfigError(_install_hint(where))
    stamp = where / STAMP
    if stamp.is_file():
        d = json.loads(stamp.read_text())
        return Converter(where, d["llama_cpp_python"], d["llama_cpp_commit"], d["sdist_sha256"])
    return Converter(where, "unknown (a folder given by path)", _git_head(where), "")


def _git_head(where: Path) -> str:
    head = where / ".git" / "HEAD"
    try:
        return head.read_text().strip() if head.is_file() else "unknown"
    except OSError:
        return "unknown"


def install(dest: str | Path | None = None, sdist: str | Path | None = None) -> Converter:
    """Extract the converter from the pinned sdist (`sdist`, else pip downloads it from the package index) into
    `dest`; staged in a temporary folder, the stamp written last, then renamed into place."""
    dest = Path(dest or default_dir())
    with tempfile.TemporaryDirectory(prefix="memfit-sdist-") as tmp:
        if sdist is None:
            sdist = _download(Path(tmp))
        sdist = Path(sdist)
        sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            commit = _extract(sdist, staged)
            (staged / STAMP).write_text(json.dumps({"llama_cpp_python": PINNED, "llama_cpp_commit": commit,
                                                    "sdist_sha256": sha, "sdist": sdist.name}, indent=1))
            if dest.exists():
                shutil.rmtree(dest)
            staged.rename(dest)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return find(dest)


def _download(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={PINNED}", "--no-deps", "--no-binary",
           ":all:", "-q", "-d", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = tmp / SDIST
    if done.returncode != 0 or not found.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ExportError(f"could not download the llama-cpp-python {PINNED} sdist with pip ({tail[0]}); "
                          "pass it with `memfit gguf-converter install --sdist FILE`")
    return found


def _extract(sdist: Path, staged: Path) -> str:
    """The converter's members of the sdist into `staged`; llama.cpp's commit as the sdist's submodule records it."""
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        for m in tar:
            if m.name == LLAMA_CPP_HEAD and m.isfile():
                commit = tar.extractfile(m).read().decode().strip()
                continue
            if not m.name.startswith(VENDOR):
                continue
            rel = m.name[len(VENDOR):]
            if not any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in MEMBERS):
                continue
            if not (m.isfile() or m.isdir()) or ".." in Path(rel).parts:
                continue  # no links, devices or paths out of the folder
            target = staged / rel
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())
    if not (staged / "convert_hf_to_gguf.py").is_file():
        raise ExportError(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py in it (is it llama-cpp-python "
                          f"{PINNED}'s sdist?)")
    return commit


def architectures(conv: Converter) -> frozenset[str]:
    """The HF architectures (config.json `architectures`) the converter registers, read from its source: no
    import, so the check before training costs milliseconds."""
    names: set[str] = set()
    for path in [conv.dir / "convert_hf_to_gguf.py", *sorted((conv.dir / "conversion").glob("*.py"))]:
        for args in _REGISTER.findall(path.read_text(encoding="utf-8")):
            names.update(re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", args))
    return frozenset(names)


def run(conv: Converter, script: str, args: list[str], *, pre_tokenizer: str | None = None,
        timeout: float = 3600) -> str:
    """One converter script in its own interpreter (its gguf-py, not the installed gguf), with memfit's runner
    (memfit.release.gguf_runner) around it; ExportError with the converter's last line when it fails."""
    cmd = [sys.executable, "-m", "memfit.release.gguf_runner", str(conv.dir), script, *args]
    env = {**os.environ, "MEMFIT_GGUF_PRE": pre_tokenizer or ""}
    env.pop("NO_LOCAL_GGUF", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip() and not ln.startswith(("INFO:", " "))]
        raise ExportError(f"gguf: llama.cpp's {script} failed (exit {done.returncode}): "
                          f"{lines[-1] if lines else 'no output'}")
    return done.stderr
