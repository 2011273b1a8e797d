"""The MLflow model registry: log an export as a pyfunc model, gate it against the champion, register, promote."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from memfit.errors import TrackingError

log = logging.getLogger("memfit.registry")

MODEL_CODE = Path(__file__).with_name("pyfunc.py")  # copied into each logged model: loading never imports memfit
GATE_METRIC = "val_perplexity"
# Tags on a model version, so a champion's figures survive even if its run is deleted.
TAG_PREFIX = "memfit."


@dataclass
class Champion:
    """The version an alias points at: what the next candidate must beat."""

    version: str
    run_id: str | None
    metrics: dict[str, float]
    source: str
    model_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class GateResult:
    passed: bool
    reason: str


@dataclass
class RegistryOutcome:
    """What the registry step did for one run (JSON-able; goes into the export report)."""

    model_name: str
    gate_passed: bool
    gate_reason: str
    model_uri: str | None = None
    version: str | None = None
    alias: str | None = None
    previous_champion: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def current_champion(client: Any, name: str, alias: str = "champion") -> Champion | None:
    """The version `name@alias` with its metrics (version tags first, then its run's), or None."""
    from mlflow.exceptions import MlflowException

    try:
        mv = client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if getattr(err, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise
    metrics: dict[str, float] = {}
    if mv.run_id:
        with contextlib.suppress(MlflowException):
            metrics.update(client.get_run(mv.run_id).data.metrics)
    for key, value in (mv.tags or {}).items():
        if key.startswith(TAG_PREFIX + "metric."):
            with contextlib.suppress(ValueError):
                metrics[key.removeprefix(TAG_PREFIX + "metric.")] = float(value)
    return Champion(version=str(mv.version), run_id=mv.run_id, metrics=metrics, source=mv.source,
                    model_id=getattr(mv, "model_id", None), tags=dict(mv.tags or {}))


def gate(metrics: dict[str, float], champion_metrics: dict[str, float] | None, gate_cfg: Any) -> GateResult:
    """Pure: does a candidate with `metrics` pass eval.gate (threshold and/or beating the champion)?"""
    ppl = metrics.get(GATE_METRIC)
    if ppl is None or not math.isfinite(ppl):
        return GateResult(False, f"{GATE_METRIC} is {ppl}: nothing to judge the model by")
    reasons = []
    if gate_cfg.max_perplexity is not None:
        if ppl > gate_cfg.max_perplexity:
            return GateResult(False, f"{GATE_METRIC} {ppl:.4f} > eval.gate.max_perplexity {gate_cfg.max_perplexity:g}")
        reasons.append(f"{GATE_METRIC} {ppl:.4f} <= eval.gate.max_perplexity {gate_cfg.max_perplexity:g}")
    if gate_cfg.beat_champion:
        theirs = (champion_metrics or {}).get(GATE_METRIC)
        if champion_metrics is None:
            reasons.append("no champion yet")
        elif theirs is None or not math.isfinite(theirs):
            reasons.append(f"the champion has no finite {GATE_METRIC}")
        elif ppl < theirs:
            reasons.append(f"{GATE_METRIC} {ppl:.4f} beats the champion's {theirs:.4f}")
        else:
            return GateResult(False, f"{GATE_METRIC} {ppl:.4f} does not beat the champion's {theirs:.4f} "
                                     "(eval.gate.beat_champion)")
    failed = _metric_rules(metrics, champion_metrics, getattr(gate_cfg, "metrics", None) or {}, reasons)
    if failed:
        return GateResult(False, failed)
    return GateResult(True, "; ".join(reasons) or "no gate configured")


def _metric_rules(metrics: dict[str, float], champion: dict[str, float] | None, rules: dict[str, Any],
                  reasons: list[str]) -> str | None:
    """eval.gate.metrics on task scores (higher is better): the first rule broken, as one line naming the metric,
    both values and the threshold; the rules kept are appended to `reasons`."""
    for key, rule in rules.items():
        rule = rule if isinstance(rule, dict) else vars(rule)
        name, field_ = f"eval/{key}", f"eval.gate.metrics[{key!r}]"
        ours = metrics.get(name)
        if ours is None or not math.isfinite(ours):
            produced = sorted(k for k in metrics if k.startswith(f"eval/{key.split('/')[0]}/"))
            return f"{name}: no task produced it (produced: {', '.join(produced) or 'none'}); fix {field_}"
        if rule.get("min") is not None:
            if ours < rule["min"]:
                return f"{name} {ours:.4f} < {field_}.min {rule['min']:g}"
            reasons.append(f"{name} {ours:.4f} >= {rule['min']:g}")
        if rule.get("max_drop") is not None:
            # The champion judged now on the same data (eval.compare_champion), else what its run recorded.
            theirs = metrics.get(f"champion/{name}", (champion or {}).get(name))
            if theirs is None or not math.isfinite(theirs):
                reasons.append(f"the champion has no {name}: max_drop not applied")
            elif theirs - ours > rule["max_drop"]:
                return (f"{name} {ours:.4f} is {theirs - ours:.4f} below the champion's {theirs:.4f} "
                        f"(> {field_}.max_drop {rule['max_drop']:g})")
            else:
                reasons.append(f"{name} {ours:.4f} vs the champion's {theirs:.4f}")
    return None


@contextlib.contextmanager
def _tracking_uri(uri: str):
    # mlflow's model logging reads the global tracking URI (and mirrors it into $MLFLOW_TRACKING_URI):
    # set both for the call, then put both back as they were.
    import os

    from mlflow.tracking._tracking_service import utils

    previous, env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    utils.set_tracking_uri(uri)
    try:
        yield
    finally:
        utils.set_tracking_uri(previous)
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env


def _requirements() -> list[str]:
    reqs = []
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            reqs.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            reqs.append(dist)
    return reqs


def _weights_digest(export_dir: Path) -> str | None:
    try:
        manifest = json.loads((export_dir / "memfit-export.json").read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files", {})
    return ",".join(f"{k}:{v['sha256'][:16]}" for k, v in sorted(files.items()) if k.endswith(".safetensors"))


def log_model(client: Any, tracking_uri: str, run_id: str, export_dir: str | Path, name: str = "model",
              metadata: dict[str, Any] | None = None) -> tuple[str, str]:
    """Log the SafeTensors export as a pyfunc (from code, nothing pickled) in run_id; (model_uri, model_id).

    The same weights logged before in this run (a re-run of a finished run) are reused, not logged twice.
    """
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array, Object, Property

    export_dir = Path(export_dir)
    digest = _weights_digest(export_dir)
    run = client.get_run(run_id)
    if digest:
        found = client.search_logged_models(
            experiment_ids=[run.info.experiment_id],
            filter_string=f"source_run_id = '{run_id}' AND tags.`memfit.weights` = '{digest}'", max_results=20)
        ready = [m for m in found if str(getattr(m.status, "name", m.status)).upper().endswith("READY")]
        if ready:
            return f"models:/{ready[0].model_id}", ready[0].model_id
    # A row holds a prompt or a conversation (rendered with the export's chat template).
    turn = Object([Property("role", "string"), Property("content", "string")])
    inputs = Schema([ColSpec("string", "prompt", required=False), ColSpec(Array(turn), "messages", required=False)])
    signature = ModelSignature(inputs=inputs, outputs=Schema([ColSpec("string")]),
                               params=ParamSchema([ParamSpec("max_new_tokens", "long", 32)]))
    # Created here, in the run's experiment: left to itself, mlflow files it under the *active* experiment.
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        tags={"memfit.weights": digest or "unknown"}, params=run.data.params)
    with _tracking_uri(tracking_uri), warnings.catch_warnings():
        # Nothing to act on: the signature is explicit, and an input example would load the model again. (MLflow's
        # "Add type hints" warning is answered in pyfunc.py itself: its own "once" filter would override one here.)
        warnings.filterwarnings("ignore", message=".*(input example|input_example).*")
        info = mlflow.models.Model.log(
            None, name=name, flavor=mlflow.pyfunc, run_id=run_id, model_id=logged.model_id,
            python_model=str(MODEL_CODE), artifacts={"hf": str(export_dir)}, pip_requirements=_requirements(),
            signature=signature, metadata=metadata)
    return info.model_uri, info.model_id


def register(client: Any, name: str, model_uri: str, run_id: str, model_id: str | None,
             tags: dict[str, str] | None = None) -> str:
    """A version of `name` for this model (created with the registered model if new); reused when it exists."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="Causal LM fine-tuned by memfit (pyfunc over a "
                                       "SafeTensors Hugging Face folder).")
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
    for mv in client.search_model_versions(f"name = '{_quote(name)}' and run_id = '{run_id}'"):
        if mv.source == model_uri or (model_id and getattr(mv, "model_id", None) == model_id):
            return str(mv.version)  # a re-run of a finished run: the same model, already registered
    # The SQL registry store looks the logged model up through the *global* tracking URI.
    with _tracking_uri(client.tracking_uri):
        mv = client.create_model_version(name, source=model_uri, run_id=run_id, model_id=model_id,
                                         tags={k: str(v) for k, v in (tags or {}).items()})
    return str(mv.version)


def promote(client: Any, name: str, version: str, alias: str = "champion") -> None:
    client.set_registered_model_alias(name, alias, version)


def _quote(name: str) -> str:
    return name.replace("'", "\\'")


def publish(client: Any, tracking_uri: str, run_id: str, export_dir: str | Path, metrics: dict[str, float],
            model_name: str, gate_cfg: Any, alias: str = "champion",
            version_tags: dict[str, str] | None = None) -> RegistryOutcome:
    """Log the export as a model in the run, gate it, and register + promote only when the gate passes."""
    champion = current_champion(client, model_name, alias)
    model_uri, model_id = log_model(client, tracking_uri, run_id, export_dir)
    if champion is not None and champion.run_id == run_id:
        result = GateResult(True, f"this run is already {model_name}@{alias} (version {champion.version})")
    else:
        result = gate(metrics, champion.metrics if champion else None, gate_cfg)
    outcome = RegistryOutcome(model_name=model_name, gate_passed=result.passed, gate_reason=result.reason,
                              model_uri=model_uri, previous_champion=champion.version if champion else None)
    if not result.passed:
        log.warning("eval gate failed for %s: %s; not registered", model_name, result.reason)
        return outcome
    tags = {**(version_tags or {}), **{f"{TAG_PREFIX}metric.{k}": str(v) for k, v in metrics.items()}}
    outcome.version = register(client, model_name, model_uri, run_id, model_id, tags)
    promote(client, model_name, outcome.version, alias)
    outcome.alias = alias
    log.info("registered %s version %s and set alias %s (%s)", model_name, outcome.version, alias, result.reason)
    return outcome


def fetch_champion(tracking_uri: str, name: str, dest: str | Path, alias: str = "champion") -> Path:
    """Download `name@alias` and return its SafeTensors folder, checksums verified (for fine-tuning from it)."""
    from mlflow.artifacts import download_artifacts

    from memfit.files import sha256_file
    from memfit.release.formats import MANIFEST_NAME

    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        from mlflow import MlflowClient

        # Resolve the alias with a client bound to this store: `models:/` URIs otherwise go through the
        # process-wide registry URI, which may point at another store.
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        version = client.get_model_version_by_alias(name, alias).version
        source = client.get_model_version_download_uri(name, version)
        local = Path(download_artifacts(artifact_uri=source, dst_path=str(dest), tracking_uri=tracking_uri))
    except Exception as err:  # noqa: BLE001 - MlflowException and transport errors alike
        raise TrackingError(f"registry: cannot download models:/{name}@{alias} ({err})") from None
    folder = local / "artifacts" / "hf"
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    for rel, meta in manifest["files"].items():
        if sha256_file(folder / rel) != meta["sha256"]:
            raise TrackingError(f"registry: {name}@{alias} file {rel} does not match its export checksum")
    return folder


def publish_on_tracker(tracker: Any, export_dir: str, metrics: dict[str, float], model_name: str, gate: dict[str, Any],
            alias: str, version_tags: dict[str, str]) -> dict[str, Any]:
    """publish() on a tracker's run, where its store is open (records.on_tracker: the tracking process in `memfit
    run`); `gate` is the eval.gate section as a dict. Returns the RegistryOutcome as a dict."""
    tracker.flush()
    outcome = publish(tracker.client, tracker.tracking_uri, tracker.run_id, export_dir, metrics, model_name,
                            SimpleNamespace(**gate), alias, version_tags)
    return outcome.to_dict()
