"""The tracker Protocol (MLflow, null) and the redaction every backend applies before logging."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

# Keys that look like credentials never reach a tracker, whatever the backend. `token` but not
# `tokens`/`tokenizer`: eval.max_new_tokens and tokens_per_s are not secrets.
_SECRET_KEY = re.compile(r"(secret|password|passwd|token(?!s|iz)|api[_-]?key|access[_-]?key|credential|private"
                         r"|auth)", re.I)
REDACTED = "***"
# Values that are secrets whatever key they sit under: a password inside a URL, and token formats
# that announce themselves (AWS key ids, Hugging Face, GitHub, OpenAI-style, Slack, PEM blocks).
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]*):(?P<pw>[^/\s@]+)@")
_TOKEN_PATTERNS = re.compile(
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bhf_[A-Za-z0-9]{30,}\b|\bgh[pousr]_[A-Za-z0-9]{30,}\b"
    r"|\bgithub_pat_[A-Za-z0-9_]{20,}\b|\bsk-[A-Za-z0-9_-]{20,}\b|\bxox[abpr]-[A-Za-z0-9-]{10,}\b"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S)
# Shorter values would match ordinary words ("testing", "admin") all over a run's text.
MIN_SECRET_LEN = 8


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look like credentials (longest first)."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if is_secret_key(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)


def scrub(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with environment secrets, URL passwords and self-announcing tokens replaced by ***."""
    if not text:
        return text
    for value in secret_values(environ):
        text = text.replace(value, REDACTED)
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    return _TOKEN_PATTERNS.sub(REDACTED, text)


def scrub_obj(obj: Any, environ: Mapping[str, str] | None = None) -> Any:
    """scrub() over every string inside dicts/lists (keys that look like secrets get *** values)."""
    if isinstance(obj, str):
        return scrub(obj, environ)
    if isinstance(obj, Mapping):
        return {k: (REDACTED if isinstance(k, str) and is_secret_key(k) and v not in (None, "")
                    else scrub_obj(v, environ)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub_obj(v, environ) for v in obj)
    return obj


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Params/tags ready to log: secret-looking keys masked, secret values scrubbed from the rest."""
    def clean(v: Any) -> Any:
        return v if v is None or isinstance(v, (bool, int, float)) else scrub(v if isinstance(v, str) else str(v))

    return {k: (REDACTED if is_secret_key(k) and v not in (None, "") else clean(v)) for k, v in params.items()}


class Tracker(Protocol):
    """Experiment tracking for one run at a time; metrics may be buffered until `flush`."""

    run_id: str | None

    continued: bool  # after start_run: True when it reopened the run it was given, False for a new run

    def start_run(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None: ...

    def log_dataset(self, name: str, digest: str, source: str, context: str,
                    profile: dict[str, Any] | None = None) -> None: ...

    def metric_history(self, key: str) -> list[tuple[int, float]]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def end_run(self, status: str = "FINISHED") -> None: ...

    def describe(self) -> str: ...
