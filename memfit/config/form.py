"""The run form: the settings people change per run, first in the Prefect UI; the full config tree follows."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from memfit.config.release import Section

# Form field → the config key it sets (the rest of the tree is the form's advanced part).
KEYS = {"model": "model.name_or_path", "data": "data.path", "max_steps": "train.max_steps", "lr": "train.lr",
        "batch_size": "train.batch_size", "device": "memory.device", "budget_gb": "memory.budget_gb",
        "lora": "lora.enabled", "max_restarts": "recovery.max_restarts", "objective": "train.objective"}


class RunForm(Section):
    """What changes from run to run. An empty field keeps the value in `config` below (the full tree)."""

    model: str | None = Field(None, description="The model to fine-tune: a local Hugging Face folder or a hub id "
                              "(model.name_or_path).")
    data: str | None = Field(None, description="Training data: a .txt / .jsonl / .parquet / .csv file or folder, "
                             "a saved dataset or hf:NAME (data.path).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to train for (train.max_steps).")
    lr: float | None = Field(None, gt=0.0, description="Peak learning rate (train.lr).")
    batch_size: int | None = Field(None, ge=1, description="Global batch in sequences (train.batch_size).")
    device: str | None = Field(None, description="The GPU the plan is made for, e.g. a100-80gb, l4, rtx-4090 "
                               "(memory.device).")
    budget_gb: float | None = Field(None, gt=0.0, description="Memory budget in GB instead of the device's "
                                    "(memory.budget_gb).")
    lora: bool | None = Field(None, description="Train LoRA adapters on a frozen base (lora.enabled).")
    max_restarts: int | None = Field(None, ge=0, description="Restarts after a preemption or a vanished machine "
                                     "(recovery.max_restarts).")

    objective: Literal["sft", "dpo"] | None = Field(
        None, description="sft: next-token loss; dpo: preference pairs (prompt, chosen, rejected) with the dpo "
        "section's loss (train.objective).")

    def overrides(self) -> dict[str, Any]:
        """Dotted config key → value, for the fields that are set."""
        return {KEYS[name]: value for name, value in self.model_dump().items() if value is not None}

    def apply(self, cfg: Any) -> Any:
        """`cfg` with the form's values set, validated as one tree (an error names the config key)."""
        from memfit.config import from_dict

        changes = self.overrides()
        if not changes:
            return cfg
        data = cfg.model_dump(mode="json")
        for dotted, value in changes.items():
            section, key = dotted.split(".")
            data[section][key] = value
        if "model.name_or_path" in changes:
            data["model"]["preset"] = None
        return from_dict(data, "the run form over the config")
