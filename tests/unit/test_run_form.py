"""The run form: the per-run knobs lead the Prefect form; empty ones keep the config; errors name the config key."""

from __future__ import annotations

import pytest

from memfit import config as cfgmod
from memfit.config.form import KEYS, RunForm
from memfit.errors import ConfigError

pytestmark = pytest.mark.unit


def test_the_flow_form_leads_with_the_per_run_knobs_and_keeps_the_tree_below():
    from flows.finetune import finetune

    schema = finetune.parameters.model_dump()
    assert list(schema["properties"]) == ["form", "config"]
    assert schema["properties"]["form"]["position"] == 0 and schema["properties"]["config"]["position"] == 1
    form = schema["definitions"]["RunForm"]["properties"]
    assert list(form) == ["model", "data", "max_steps", "lr", "batch_size", "device", "budget_gb", "lora",
                          "max_restarts", "objective"]
    assert "train.max_steps" in form["max_steps"]["description"]
    assert len(schema["definitions"]["MemfitConfig"]["properties"]) >= 15  # the whole tree, as before


def test_an_empty_form_changes_nothing_and_a_filled_one_sets_its_keys():
    base = cfgmod.load(None, ["train.max_steps=60"])
    assert RunForm().apply(base) is base
    cfg = RunForm(model="org/model", data="train.jsonl", max_steps=7, lr=1e-4, batch_size=8, lora=True,
                  max_restarts=0, device="a100-80gb").apply(base)
    assert (cfg.model.name_or_path, cfg.model.preset, cfg.data.path) == ("org/model", None, "train.jsonl")
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.batch_size) == (7, 1e-4, 8)
    assert cfg.lora.enabled and cfg.recovery.max_restarts == 0 and cfg.memory.device == "a100-80gb"
    assert set(KEYS.values()) <= set(cfg.flat())  # every knob names a real key
    assert RunForm(objective="dpo").apply(base).train.objective == "dpo"


def test_a_bad_value_names_the_config_key():
    with pytest.raises(ConfigError, match=r"memory\.device: unknown device"):
        RunForm(device="tpu-9000").apply(cfgmod.load(None, []))
    with pytest.raises(ConfigError, match="train.batch_size"):  # 3 sequences do not split into 2 micro-batches
        RunForm(batch_size=3).apply(cfgmod.load(None, ["train.grad_accum_steps=2"]))


def test_the_flow_validates_its_parameters_as_a_deployment_run_sends_them():
    # Prefect validates a deployment run's JSON parameters against the flow's signature before it starts.
    from flows.finetune import finetune

    cfg = cfgmod.load(None, []).model_dump(mode="json")
    params = finetune.validate_parameters({"form": {"max_steps": 5}, "config": cfg})
    assert params["form"].max_steps == 5 and params["config"].train.max_steps == cfg["train"]["max_steps"]
    assert isinstance(finetune.validate_parameters({"config": cfg})["form"], RunForm)
