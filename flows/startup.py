"""`memfit run`'s start-up: what the first training step needs, imported and opened while Prefect's server boots."""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.runtime.termination import Interrupted

log = logging.getLogger("memfit.startup")
_PRESET_TYPES = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}


def warm_up(cfg: Any, server_ready: Callable[[], bool] = lambda: False) -> list[str]:
    """Do now, on this process's core, the start-up work the flow would do later anyway (imports, the local
    MLflow store), while the server boots on the other core; returns what it did.

    It stops once `server_ready()`: from then on a part would only delay the flow (the inputs, built here,
    are built again by phase 1 from the disk cache), so the phases do the rest themselves. Each part only
    prepares: a failure is left for the phase that meets it, which reports it in its own words.
    """
    done = []
    parts: list[tuple[str, Callable[[Any], bool]]] = [("model classes", _model_classes), ("inputs", _inputs),
                                                      ("MLflow store", _tracking_store), ("trainer", _trainer)]
    for name, part in parts:
        if server_ready():
            break
        try:
            if part(cfg):
                done.append(name)
        except Interrupted:  # a stop signal (memfit/runtime/termination.py) ends the run here as anywhere
            raise
        except Exception as err:  # noqa: BLE001 - see the docstring: the phase itself reports it
            log.debug("start-up warm-up of the %s skipped: %s", name, err)
    return done


def model_type(cfg: Any) -> str | None:
    """The transformers model type of the run's model, from its preset or a local config.json; None if unknown."""
    if not cfg.model.name_or_path:
        return _PRESET_TYPES.get(cfg.model.preset)
    config_file = Path(cfg.model.name_or_path) / "config.json"
    if not config_file.is_file():
        return None  # a hub name: resolved (and reported) by phase 1
    value = json.loads(config_file.read_text()).get("model_type")
    return value if isinstance(value, str) and value.isidentifier() else None


def _model_classes(cfg: Any) -> bool:
    kind = model_type(cfg)
    if kind is None:
        return False
    importlib.import_module("transformers")  # attribute access below imports the lazy submodules
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401

    importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    return True


def _inputs(cfg: Any) -> bool:
    """Phases 1 and 3's inputs: a preset model and tokenizer built, the data packed. Both are cached on disk by
    content (written under a temporary name, then renamed), so the phases load what this wrote, as a second run
    of the same config would. Presets only: a model given by path can be large, and is loaded by phase 1."""
    if cfg.model.name_or_path:
        return False
    from memfit.data.cache import cached_data
    from memfit.run_context import load_inputs

    inputs = load_inputs(cfg)
    cached_data(cfg, inputs.texts, inputs.digest, inputs.tokenizer)
    return True


def _tracking_store(cfg: Any) -> bool:
    """A local SQLite store (a new one copied from a migrated one: tracking/sqlite_seed.py) and MLflow's client
    modules. The store object is cached by MLflow, so phase 3's tracker opens the same one. Remote stores are left
    alone (the network is phase 3's, with its retries and its message)."""
    from memfit.tracking.process import prestarted

    if cfg.tracking.backend != "mlflow" or prestarted(cfg.tracking):
        return False  # the tracking process opens it, on the other core (memfit/tracking/process.py)
    uri = cfg.tracking.resolved_uri()
    if not uri.startswith("sqlite:///"):
        return False
    import memfit.tracking.mlflow_tracker  # noqa: F401 - the module phase 3 opens the store with
    from memfit.tracking.sqlite_seed import open_client

    open_client(uri)
    if cfg.tracking.system_metrics:
        importlib.import_module("mlflow.system_metrics.system_metrics_monitor")
    return True


def _trainer(cfg: Any) -> bool:
    importlib.import_module("memfit.training.loop")
    return True
