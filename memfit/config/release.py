"""The config sections after training: export, the eval gate, the registry, deployment, recovery and serving."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """The base of every config section (here, so config.py and this module share it without a cycle)."""

    # extra="forbid" turns a typo in a YAML key into an error instead of a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ExportFormat = Literal["safetensors", "onnx", "adapter", "gguf", "gguf-adapter"]
GgufQuant = Literal["f16", "q8_0", "q4_k_m"]


class GgufMinTop1(Section):
    """Per GGUF file: the min fraction of positions (the eval prompts, then transformers' greedy tokens after them)
    whose top-1 token from llama.cpp equals transformers'. Measured on tiny models in docs/export.md."""

    f16: float = Field(0.98, ge=0.0, le=1.0, description="f16 (which must also give transformers' greedy tokens on "
                       "every prompt). Measured: 100% (tiny models of the 15 families in docs/export.md).")
    q8_0: float = Field(0.9, ge=0.0, le=1.0, description="q8_0 (8-bit blocks). Measured: 96.7% to 100% on "
                        "random-weight tiny models, whose near-flat logits flip near-ties.")
    q4_k_m: float = Field(0.5, ge=0.0, le=1.0, description="q4_k_m (4-bit k-quant; rows narrower than 256 fall back "
                          "to 5- and 8-bit blocks). Measured: 93% on a random-weight tiny Llama.")


class ExportConfig(Section):
    dir: str = Field("runs/export", description="Folder for the exports: hf/ (SafeTensors), model.onnx, adapter/, "
                     "gguf/.")
    formats: list[ExportFormat] | None = Field(
        None, description="The exports phase 5 and `memfit export` write, each verified in the runtime that loads "
        "it: safetensors (the merged HF folder, always: every other format is made from it and checked against it), "
        "onnx (onnxruntime parity), adapter (LoRA runs: the peft folder), gguf (llama.cpp / Ollama: "
        "export.gguf_quants, checked by llama-cpp-python; needs `pip install 'memfit[gguf]'` and `memfit "
        "gguf-converter install`), gguf-adapter (LoRA runs: the adapter as GGUF on its base's GGUF, for llama.cpp's "
        "--lora and Ollama's ADAPTER). Unset: safetensors, "
        "plus onnx and adapter as export.onnx and export.adapter say (their older spelling, kept in step).")
    gguf_quants: list[GgufQuant] = Field(
        default_factory=lambda: ["f16", "q8_0"], min_length=1, description="GGUF files written to export.dir/gguf: "
        "f16 (llama.cpp's own convert_hf_to_gguf.py), q8_0 and q4_k_m (llama.cpp's own quantizer from the f16 "
        "file). The Modelfile's FROM is the first quantized one listed, else f16.")
    gguf_converter: str | None = Field(
        None, description="A folder holding llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/, "
        "e.g. a llama.cpp checkout) to write the f16 GGUF with. Unset: $MEMFIT_GGUF_CONVERTER, else the one "
        "`memfit gguf-converter install` put beside the packages (from the pinned llama-cpp-python sdist).")
    gguf_min_top1: GgufMinTop1 = Field(default_factory=lambda: GgufMinTop1(), description="Per GGUF file: the "
                                       "min top-1 agreement with transformers that verification accepts.")
    gguf_adapter_base: str | None = Field(
        None, description="export.formats gguf-adapter: a GGUF of the base model the run trained on that you already "
        "have (e.g. the one you serve); the adapter is verified on it and the Modelfile's FROM names it by its path. "
        "Unset: llama.cpp's converter writes the base itself (gguf-adapter/base-QUANT.gguf for export.gguf_quants).")
    onnx: bool = Field(True, description="Also export and verify ONNX (the same as listing onnx in export.formats).")
    adapter: bool = Field(False, description="LoRA runs: also write the adapter alone as a peft folder "
                          "(export.dir/adapter: adapter weights and config naming the base, the tokenizer and chat "
                          "template, the base's checksum) for multi-LoRA serving (vLLM, TGI), verified by loading "
                          "base + adapter with peft against the merged export's logits (the onnx_* limits).")
    # ONNX parity: onnxruntime's logits vs PyTorch fp32 at a few (batch, seq) shapes; every criterion must
    # hold at every shape. Defaults from bench/onnx_parity.py (random Llama-family models, 0.2 M to 135 M
    # parameters, final norm scaled so max |logit| ~ 20 as in pretrained models), see each description.
    onnx_rtol: float = Field(
        5e-4, ge=0.0, description="Max |onnxruntime - PyTorch| logits allowed, as a fraction of max |logit| at "
        "that shape. Measured fp32 rounding: relative <= 4.5e-7 (0.2 M parameters) to 1.5e-6 (135 M), 9.4e-6 for a "
        "pretrained 135 M Llama (issue 12); one weight matrix of the graph perturbed by 1% of its std: 1.1e-3 to "
        "2.3e-3, by 0.1%: 1.1e-4 to 2.3e-4 (passes).")
    onnx_atol: float = Field(1e-4, ge=0.0, description="Absolute part of the same bound (logit units), added to "
                             "onnx_rtol x max |logit|: it matters only for models whose logits are near 0.")
    onnx_max_kl: float = Field(
        1e-5, ge=0.0, description="Max KL(softmax PyTorch || softmax ONNX) per position, in nats: the distribution "
        "sampling sees. Measured fp32 rounding: <= 1.1e-10 (0.2 M to 135 M parameters); one weight matrix "
        "perturbed by 1% of its std: 1.3e-5 to 1.1e-4, by 0.1%: <= 1.1e-6 (passes).")
    onnx_min_top1: float = Field(
        0.95, ge=0.0, le=1.0, description="Min fraction of verification positions whose top-1 token agrees (what "
        "greedy decoding sees); below 1 because rounding can flip a near-tie. Measured fp32 rounding: 100%; one "
        "weight matrix perturbed by 1% of its std: 97% to 100% per shape, by 10%: 87% to 100% (so the KL and "
        "max-diff limits catch a wrong graph first; top-1 says whether greedy outputs changed).")
    opset: int | None = Field(None, ge=13, description="ONNX opset; default: the exporter's.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="dtype of the SafeTensors export's weights (LoRA adapters merged first, a 4-bit "
        "base dequantized); the ONNX export and its parity check stay fp32.")
    uri: str | None = Field(None, description="Also upload the verified export here (a folder or "
                            "s3://bucket/prefix), files first and a manifest.json last. Unset: local only.")

    @model_validator(mode="after")
    def _formats_and_flags_agree(self) -> ExportConfig:
        if self.formats is None:
            return self
        if "safetensors" not in self.formats:
            raise ValueError("export.formats: safetensors is the export every other format is made from and "
                             "checked against; keep it in the list")
        for flag in ("onnx", "adapter"):
            listed = flag in self.formats
            if flag in self.model_fields_set and getattr(self, flag) != listed:
                raise ValueError(f"export.{flag}={str(getattr(self, flag)).lower()} contradicts export.formats "
                                 f"{self.formats}; set only export.formats")
            self.__dict__[flag] = listed  # kept in step without re-validating (validate_assignment)
        return self

    def enabled_formats(self) -> list[str]:
        """The formats to write, in the order they are written."""
        chosen = self.formats or ["safetensors", *(["onnx"] if self.onnx else []),
                                  *(["adapter"] if self.adapter else [])]
        return [f for f in ("safetensors", "onnx", "adapter", "gguf", "gguf-adapter") if f in chosen]


class MetricGate(Section):
    min: float | None = Field(None, description="The candidate's value must be at least this.")
    max_drop: float | None = Field(None, ge=0.0, description="The candidate may be at most this much below the "
                                   "champion's value (when the champion has the metric).")


class GateConfig(Section):
    max_perplexity: float | None = Field(None, gt=1.0, description="Register only when validation perplexity "
                                         "is at most this. Unset: no threshold.")
    beat_champion: bool = Field(True, description="Register only when validation perplexity is lower than the "
                                "current champion's (a first model, with no champion, passes).")
    metrics: dict[str, MetricGate] = Field(
        default_factory=dict, description="Rules on task scores, keyed TASK/METRIC as logged under eval/ (e.g. "
        "`my_mc/acc: {min: 0.5, max_drop: 0.02}`); higher is better. Every TASK must be in eval.tasks or "
        "eval.sets, or be `preference` (a DPO run: preference/accuracy, preference/margin on its held-out pairs, "
        "the champion scored on the same pairs).")


class EvalSetConfig(Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="The set's name in MLflow (eval/NAME/METRIC) "
                      "and in eval.gate.metrics.")
    path: str = Field(..., description="A JSONL file: one record a line, `prompt` (text) or `messages` (a "
                      "conversation, answered with the chat template) and `reference` (the expected answer).")
    metrics: list[Literal["exact_match", "contains", "rouge_l"]] = Field(
        default_factory=lambda: ["exact_match"], min_length=1, description="Scores per answer: exact_match "
        "(case-insensitive), contains (the reference appears in the answer), rouge_l (ROUGE-L F1).")
    extract: str | None = Field(None, description="A regex applied to the answer before scoring; its first group "
                                "(or the whole match) is scored, e.g. `(-?\\d+)` for a number. Unset: the whole "
                                "answer.")
    max_new_tokens: int | None = Field(None, ge=1, le=2048, description="Tokens generated per answer. Unset: "
                                       "eval.max_new_tokens.")


class EvalConfig(Section):
    prompts: list[str] = Field(
        default_factory=lambda: ["one two three", "the red fox", "3 plus 4 is"], max_length=64,
        description="Fixed prompts whose greedy continuations are logged as an MLflow table (eval/generations).")
    max_new_tokens: int = Field(16, ge=1, le=512, description="Tokens generated per prompt (greedy, KV cache on).")
    tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness tasks run on the SafeTensors export in phase 5 "
        "(its Hugging Face backend): the harness's own (their data from the hub, where the network allows) or "
        "local task YAMLs found under eval.task_paths. Scores and standard errors go to MLflow as "
        "eval/TASK/METRIC. Needs `pip install 'memfit[eval]'`.")
    task_paths: list[str] = Field(default_factory=list, description="Folders of local task YAMLs (the harness's "
                                  "include_path); their data files are checked before training.")
    limit: int | None = Field(None, ge=1, description="At most this many examples per task. Unset: all.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt. Unset: the task's own.")
    batch_size: int = Field(1, ge=1, le=256, description="Requests per forward pass in the harness.")
    sets: list[EvalSetConfig] = Field(default_factory=list, description="The team's own eval sets: prompts with "
                                      "reference answers, answered greedily by the export and scored.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="The dtype phase 5 evaluates in on the training device (validation loss, generations, "
        "tasks, sets; the champion too). Exports are written and checked from fp32 weights in host memory either "
        "way. auto: fp32, unless on CUDA its predicted peak exceeds the free memory: then bf16 (fp16 without bf16), "
        "half the weights' bytes; the plan says which.")
    compare_champion: bool = Field(True, description="Run the same tasks and sets on the current champion too: "
                                   "its scores (champion/eval/...) feed max_drop, and a side-by-side table per "
                                   "example is logged (eval/compare/...).")
    gate: GateConfig = Field(default_factory=GateConfig, description="The eval gate deciding registration.")

    @model_validator(mode="after")
    def _gated_metrics_come_from_tasks(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        clash = sorted({n for n in names if names.count(n) > 1 or n in self.tasks or n == "preference"})
        if clash:
            raise ValueError(f"eval.sets: {', '.join(clash)} named twice (sets and tasks share eval/NAME/..., and "
                             "preference is a DPO run's held-out pairs); rename the set")
        for key in self.gate.metrics:
            task, _, metric = key.partition("/")
            if not metric:
                raise ValueError(f"eval.gate.metrics: {key!r} is not TASK/METRIC (e.g. my_task/acc)")
            if task == "preference" and metric not in ("accuracy", "margin"):
                raise ValueError(f"eval.gate.metrics: {key!r}: a DPO run's held-out pairs give preference/accuracy "
                                 "and preference/margin")
            if task not in self.tasks and task not in names and task != "preference":
                raise ValueError(f"eval.gate.metrics: {key!r} names {task!r}, which neither eval.tasks nor eval.sets "
                                 f"runs ({', '.join(self.tasks + names) or 'none'}); add it or drop the rule")
        return self


class RegistryConfig(Section):
    enabled: bool = Field(True, description="Log the export as an MLflow model and register a version when the "
                          "eval gate passes (needs the MLflow tracker).")
    model_name: str | None = Field(None, min_length=1, max_length=200,
                                   description="Registered model name. Unset: run.name.")
    alias: str = Field("champion", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$",
                       description="Alias moved to a version that passes the gate.")


class DeployConfig(Section):
    """How `memfit serve` registers the Prefect deployments (finetune, retrain, export)."""

    retrain_cron: str | None = Field(None, description="Cron schedule of the retrain deployment, e.g. "
                                     "'0 3 * * *' (03:00 daily); unset: no schedule, runs only on demand.")
    timezone: str = Field("UTC", description="IANA time zone the cron schedule is read in, e.g. Europe/Berlin.")
    training_slots: int = Field(1, ge=1, le=64, description="Runs that may train at once on this machine, so two "
                                "runs never share one GPU: file locks in the Prefect home in the default mode "
                                "(freed when a run dies), a Prefect global concurrency limit with a server.")
    concurrency_key: str = Field("memfit-training", min_length=1,
                                 description="Name of the training slot (the Prefect global concurrency limit "
                                 "with a server) held while training.")
    retrain_data_uri: str | None = Field(
        None, description="Where scheduled retraining finds new data: a folder or s3://bucket/prefix of "
        ".txt/.jsonl files; the newest by name (e.g. 2026-11-30.jsonl) is used.")
    poll_seconds: int = Field(2, ge=1, le=300, description="How often `memfit serve` asks the Prefect server for "
                              "flow runs to start (a run from the UI, a schedule); it takes the place of Prefect's "
                              "PREFECT_RUNNER_POLL_FREQUENCY, whose 10 s left a run from the UI waiting up to that "
                              "long. One cheap query each time.")

    @field_validator("retrain_cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None and len(v.split()) not in (5, 6):
            raise ValueError(f"deploy.retrain_cron: {v!r} is not a cron expression (5 fields, e.g. '0 3 * * *')")
        return v

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {v!r}; use an IANA name such as UTC or Europe/Berlin") from None
        return v


class RecoveryConfig(Section):
    """Unattended recovery of deployment runs: heartbeats, Prefect automations, a restart budget (docs/spot.md)."""

    enabled: bool = Field(True, description="Restart a deployment run (memfit serve, a work pool) that was "
                          "preempted (SIGTERM, a spot notice), vanished (heartbeats stopped) or, with "
                          "on_memory_limit: leaner, stopped at the memory limit: a new flow run of the same "
                          "deployment with the same parameters resumes from the newest verified training "
                          "checkpoint. Needs the automations (`memfit serve` or `memfit automations apply`). "
                          "`memfit run` alone is never restarted by Prefect (exit 75 says: run it again).")
    max_restarts: int = Field(3, ge=0, le=100, description="Restarts one logical run may use (its training "
                              "checkpoints' store and run name); then the run ends in the RestartBudgetSpent "
                              "state, naming the budget and the last cause. 0: detect and record, never restart.")
    heartbeat_seconds: int = Field(30, ge=30, le=3600, description="How often a flow run tells the Prefect server "
                                   "it is alive (PREFECT_FLOWS_HEARTBEAT_FREQUENCY; Prefect's minimum is 30).")
    silent_after_seconds: int = Field(90, ge=31, le=86400, description="A run without a heartbeat for this long "
                                      "counts as gone (the machine vanished): it is marked Crashed and restarted. "
                                      "Longer than heartbeat_seconds; 3 heartbeats is a good start.")
    backoff_seconds: int = Field(10, ge=0, le=3600, description="Wait before the first restart; doubled for each "
                                 "further restart of the same logical run, up to max_backoff_seconds.")
    max_backoff_seconds: int = Field(300, ge=0, le=86400, description="Longest wait before a restart.")
    on_memory_limit: Literal["leaner", "stop"] = Field(
        "leaner", description="A run stopped at the memory limit (monitor.stop_at_fraction, exit 76): leaner: "
        "restart with the next leaner stack the planner offers (the plan remembers the peak that stopped it); "
        "stop: end there (the MemoryLimit state) for a person to decide.")

    @model_validator(mode="after")
    def _windows(self) -> RecoveryConfig:
        if self.heartbeat_seconds >= self.silent_after_seconds:
            raise ValueError(f"recovery.heartbeat_seconds ({self.heartbeat_seconds}) must be shorter than "
                             f"recovery.silent_after_seconds ({self.silent_after_seconds}), or every live run "
                             "would count as gone; raise silent_after_seconds (3 heartbeats is a good start)")
        if self.backoff_seconds > self.max_backoff_seconds:
            raise ValueError(f"recovery.backoff_seconds ({self.backoff_seconds}) is above "
                             f"recovery.max_backoff_seconds ({self.max_backoff_seconds})")
        return self


class ServeConfig(Section):
    """`memfit serve-model`: the OpenAI-compatible HTTP server in front of an export or the registry's champion."""

    host: str = Field("127.0.0.1", min_length=1, description="Address to listen on (0.0.0.0 in a container).")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    backend: Literal["auto", "transformers", "onnx", "llama.cpp"] = Field(
        "auto", description="transformers: the SafeTensors export with generate (KV cache); onnx: the ONNX export "
        "through onnxruntime (CPU; no KV cache in the graph); llama.cpp: the export's GGUF file (serve.gguf_quant) "
        "through llama-cpp-python (KV cache; a batch's sequences take turns); auto: onnx on CPU when the export has "
        "one (measured faster, docs/serving.md), else transformers.")
    gguf_quant: Literal["f16", "q8_0", "q4_k_m"] = Field("q8_0", description="serve.backend=llama.cpp: which GGUF "
                                                         "file of the export (gguf/model-QUANT.gguf) is served.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="transformers backend: auto is CUDA when "
                                                   "present, else CPU.")
    max_batch_size: int = Field(8, ge=1, le=256, description="Requests generated together in one batch.")
    batch_wait_ms: float = Field(5.0, ge=0.0, le=1000.0, description="How long the first request of a batch "
                                 "waits for others to join it.")
    max_queue: int = Field(64, ge=1, le=100_000, description="Requests waiting beyond the running batch; more are "
                           "answered 503 at once.")
    max_tokens: int = Field(512, ge=1, description="Largest max_tokens a request may ask for (also bounded by the "
                            "model's context).")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens of a request that sets none.")
    follow_alias: bool = Field(True, description="models:/NAME@ALIAS: poll the registry and swap in the version "
                               "the alias moves to (after checking it).")
    poll_seconds: float = Field(10.0, gt=0.0, le=86400.0, description="Seconds between registry polls.")
    cache_dir: str = Field("runs/serve", description="Where registry versions and training-checkpoint exports are "
                           "downloaded to before they are served.")
