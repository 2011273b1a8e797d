"""prefect.yaml: every entrypoint loads, every parameter set validates against the flow's schema."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=lambda d: d["name"])
def test_entrypoint_and_parameters(dep, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(REPO)
    path, _, func = dep["entrypoint"].partition(":")
    assert (REPO / path).is_file(), dep["entrypoint"]
    flow = load_flow_from_entrypoint(dep["entrypoint"], use_placeholder_flow=False)
    assert flow.fn.__name__ == func
    validated = flow.validate_parameters(dep.get("parameters", {}))
    if "config" in validated:
        from memfit.config import MemfitConfig

        assert isinstance(validated["config"], MemfitConfig)
    assert dep["work_pool"]["name"]


def test_a_bad_parameter_is_rejected(monkeypatch):
    from prefect.exceptions import ParameterTypeError
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(REPO)
    flow = load_flow_from_entrypoint("flows/finetune.py:finetune", use_placeholder_flow=False)
    with pytest.raises(ParameterTypeError):
        flow.validate_parameters({"config": {"train": {"max_steps": -1}}})


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_passes_the_servers_schema_validation(path, monkeypatch):
    """What the Prefect server checks when a deployment is applied (JSON schema, not pydantic)."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from memfit import config

    monkeypatch.chdir(REPO)
    for entrypoint in ("flows/finetune.py:finetune", "flows/retrain.py:retrain"):
        flow = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
        schema = parameter_schema(flow.fn).model_dump_for_openapi()
        params = {"config": config.load(path).model_dump(mode="json")}
        errors = validate(params, schema, raise_on_error=False, preprocess=True, ignore_required=True)
        assert errors == [], (entrypoint, errors)


def test_memfit_serve_asks_for_runs_as_often_as_deploy_poll_seconds(monkeypatch):
    """A run started from the UI waits for the runner's next query: memfit's 2 s, or the config's, not Prefect's 10.
    With recovery on, the automations are applied first, the runs send heartbeats and the deployments carry the
    tag the restart automation follows; with it off, none of that."""
    from flows import deploy, draining, recovery
    from memfit.config import load

    seen: dict = {}
    applied: list = []
    monkeypatch.setattr(draining, "serve_draining", lambda deps, **kw: seen.update(
        kw, names=[d.name for d in deps], tags=[d.tags for d in deps]))
    monkeypatch.setattr(recovery, "apply_automations", lambda cfg: applied.append(cfg) or [])
    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", raising=False)
    deploy.serve_deployments(load(REPO / "configs" / "tiny.yaml"))
    assert seen["query_seconds"] == 2 and {"finetune", "export"} <= set(seen["names"])
    assert len(applied) == 1 and os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert "memfit-recovery" in seen["tags"][0] and seen["drain_seconds"] >= 30
    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
    deploy.serve_deployments(load(REPO / "configs" / "tiny.yaml", ["deploy.poll_seconds=7", "recovery.enabled=false"]),
                             limit=1)
    assert seen["query_seconds"] == 7 and seen["limit"] == 1
    assert len(applied) == 1 and "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" not in os.environ
    assert "memfit-recovery" not in seen["tags"][0]
