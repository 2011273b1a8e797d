"""Telemetry off for every library memfit drives, before any of them is imported (no heavy imports here)."""

from __future__ import annotations

import os

OFF = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
       "HF_HUB_DISABLE_TELEMETRY": "1"}


def set_telemetry_off() -> None:
    """Default each switch to off; a value the user set explicitly is kept."""
    for k, v in OFF.items():
        os.environ.setdefault(k, v)
