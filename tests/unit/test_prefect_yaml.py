"""prefect.yaml: every entrypoint loads, every parameter set validates against the flow's schema."""

from __future__ import annotations

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
