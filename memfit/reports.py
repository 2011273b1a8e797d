"""Typed results the phases hand each other and the flow returns (JSON-able, shown in Prefect)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttemptReport(_Report):
    """Recovery: this flow run's place in its logical run (memfit/runtime/recovery.py decides it)."""

    attempt: int = Field(1, description="1 for a fresh run; n for its (n-1)th restart.")
    restarts_used: int = 0
    max_restarts: int = 0
    proceed: bool = True
    cause: str | None = Field(None, description="Why the previous attempt ended: preempted, vanished, crashed, "
                              "memory_limit, runner_shutdown.")
    duplicate_of: str | None = Field(None, description="Another live flow run of the same logical run, created "
                                     "first: this one is a duplicate restart and ends without running.")
    previous_flow_run: str | None = None
    previous_end: float | None = Field(None, description="When the previous attempt ended (epoch seconds).")
    run_key: str | None = Field(None, description="The logical run's key (its flow runs' memfit-run: tag).")
    reason: str = ""


class ProbeReport(_Report):
    """Phase 1: what hardware and libraries are here, and whether a plain training step fits."""

    environment: dict[str, Any]
    baseline: dict[str, Any] = Field(description="peak_bytes, budget_bytes, fits, headroom_bytes, breakdown...")
    model_source: str
    n_params: int
    architecture: dict[str, Any] | None = Field(None, description="The model's transformers config, for the planner.")


class PlanReport(_Report):
    """Phase 2's plan: every knob the planner decided, the predicted peak and step time, and why. Frozen: the
    trainer, profile, the ranks and export read their decisions from it (beside the config, whose auto fields
    only the planner reads); training checkpoints save it as JSON (state.json "plan") and a resume on the same
    device reuses it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    every_k: int
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    reason: str
    description: str
    block_kinds: list[str] | None = Field(None, description="Checkpointing per decoder block: none, selective, "
                                          "full or offload.")
    lora: bool = False
    quantize: str = Field("none", description="The frozen base's quantization with LoRA: none or nf4.")
    loss: str = Field("auto", description="The loss as planned: plain or chunked (auto: by the model's vocabulary, "
                      "for a plan not made by the planner, e.g. `memfit profile --compare`).")
    optimizer: str = Field("auto", description="The AdamW variant as planned (auto: by the device it runs on).")
    optimizer_in_backward: bool = Field(False, description="Each parameter stepped in backward, as planned.")
    lean_layers: bool = Field(False, description="Lean SwiGLU / RMSNorm layers, as planned.")
    fits: bool | None = None
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = Field(None, description="Predicted step time / no checkpointing - 1.")
    predicted_step_seconds: float | None = Field(None, description="The estimator's step time on the target.")
    trainable_params: int | None = Field(None, description="Parameters the plan trains: all of them, or LoRA's "
                                         "adapters (None: a plan saved before this was recorded).")
    weight_bytes: int | None = Field(None, description="The model's weights on the device as planned (a 4-bit base "
                                     "at its packed size); a DPO reference copy holds as much again.")
    device: str | None = Field(None, description="The target it was planned for: the device profile's name "
                               "(memory.device, else this machine's).")
    budget_bytes: int | None = None
    budget_source: str | None = None
    alternatives: list[dict[str, Any]] = Field(default_factory=list, description="Other candidates estimated.")
    table_markdown: str | None = None
    evaluation: dict[str, Any] | None = Field(None, description="Phase 5's predicted bytes on the device (fp32 "
                                              "weights + its largest pass) and whether they fit the limit.")

    strategy: str = Field("single", description="How ranks divide the work: single, ddp, fsdp2, deepspeed_zero2/3.")
    world_size: int = Field(1, description="Training processes in all (distributed.nproc_per_node x nnodes).")
    sharding: dict[str, Any] | None = Field(None, description="Estimated bytes per rank under the strategy "
                                            "(memfit/memory/planner/sharding.py per_rank_bytes).")
    ranks: dict[str, Any] | None = Field(None, description="With several ranks, the chosen stack's step as the "
                                         "planner divided it: one process's parts at a rank's rows, the strategy "
                                         "it held them to the limit with, and every strategy's row (sharding.py "
                                         "rank_share); None: one process, or a plan saved before this was kept.")
    reused_from_step: int | None = Field(None, description="Reused from the training checkpoint of this step, "
                                         "without planning (a resume on the same target).")
    changes: str | None = Field(None, description="A re-plan at resume: why it planned again and what differs "
                                "from the plan the training checkpoint saved.")


class ResumePoint(_Report):
    """Phase 4: the newest verified training checkpoint of this run, downloaded and ready to restore."""

    checkpoint_uri: str = Field(description="The store holding this run's training checkpoints.")
    step: int | None = None
    source_uri: str | None = Field(None, description="The checkpoint restored from, if any.")
    local_dir: str | None = None
    mlflow_run_id: str | None = None
    finished: bool = False
    plan: PlanReport | None = Field(None, description="The plan the training checkpoint's run trained with "
                                    "(None: a fresh run, or a checkpoint written before plans were saved).")


class TrainReport(_Report):
    """Phase 3: what training did."""

    mlflow_run_id: str
    start_step: int
    steps: int
    resumed_from: int | None
    preempted: bool
    initial_val_loss: float | None
    final_train_loss: float | None
    tokens_per_s: float | None = Field(description="Real (non-padding) tokens over the training loop's wall time.")
    trained_tokens_per_s: float | None = Field(None, description="Tokens with a loss label over the same time.")
    padding_fraction: float | None = Field(None, description="Padding slots computed over all slots computed.")
    peak_memory_bytes: int
    last_checkpoint_uri: str | None
    preempt_reason: str | None = None
    checkpoint_stats: dict[str, Any] | None = Field(
        None, description="Training-checkpoint saves: count, skipped, mean stall and snapshot seconds, upload MB/s.")
    memory_limit: str | None = Field(None, description="Why the memory monitor stopped training (monitor."
                                     "stop_at_fraction), when it did; the caller raises MemoryLimitError.")
    memory_limit_reading: dict[str, Any] | None = Field(
        None, description="The reading that stopped it (step, peak_bytes, budget_bytes, budget_source, measure): "
        "recorded against the planned stack so a restart plans a leaner one (memfit/memory/planner/limits.py).")


class ExportReport(_Report):
    """Phase 5: evaluation on the validation split, and the verified exports."""

    final_val_loss: float
    final_val_perplexity: float
    safetensors_dir: str
    safetensors_max_abs_diff: float
    onnx_path: str | None
    onnx_max_abs_diff: float | None
    onnx_opset: int | None
    source_checkpoint: str
    export_uri: str | None = Field(None, description="Where the export was uploaded (export.uri/<run id>).")
    registry: dict[str, Any] | None = Field(None, description="Gate result and registered version (registry.py).")
    generations: list[dict[str, Any]] = Field(default_factory=list, description="Greedy continuations of "
                                              "eval.prompts.")
    onnx_error: str | None = Field(None, description="Why the ONNX export failed (one line, with the command that "
                                   "redoes it); everything else in phase 5 completed.")
    adapter: dict[str, Any] | None = Field(None, description="The LoRA adapter folder (export.adapter): its base, "
                                           "base checksum, and base + adapter against the merged export.")
    gguf: dict[str, Any] | None = Field(None, description="The GGUF folder (export.formats: gguf): each file's "
                                        "size and figures from llama.cpp against transformers, the Modelfile.")
    gguf_adapter: dict[str, Any] | None = Field(None, description="The gguf-adapter folder (export.formats: "
                                                "gguf-adapter): the adapter and base GGUF files, llama.cpp's "
                                                "figures with and without the adapter, the Modelfile.")
    task_scores: dict[str, float] = Field(default_factory=dict, description="eval.tasks' scores on the export: "
                                          "eval/TASK/METRIC and its _stderr (memfit/evaluation/tasks.py).")


class RunSummary(_Report):
    """What `memfit run --json` prints and the flow returns."""

    status: str = Field(description="completed or preempted")
    run_name: str
    mlflow_run_id: str | None
    tracking_uri: str
    checkpoint_uri: str
    safetensors_dir: str | None
    onnx_path: str | None
    steps: int
    initial_val_loss: float | None
    final_val_loss: float | None
    final_val_perplexity: float | None = None
    onnx_max_abs_diff: float | None = None
    plan: PlanReport | None = None
    baseline: dict[str, Any] | None = None
    registered_model: str | None = Field(None, description="name@alias of the version this run registered.")
    model_version: str | None = None
    gate_passed: bool | None = None
    gate_reason: str | None = None
    export_uri: str | None = None
    onnx_error: str | None = Field(None, description="Set when the ONNX export failed: `memfit run` prints it and "
                                   "exits 2 after everything else completed.")
