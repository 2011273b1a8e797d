"""The typed config tree: defaults here, YAML files in configs/ are diffs, `--set a.b=c` on top."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from memfit.config.data import DataConfig
from memfit.config.preference import DpoConfig
from memfit.config.release import (
    DeployConfig,
    EvalConfig,
    ExportConfig,
    RecoveryConfig,
    RegistryConfig,
    ServeConfig,
)
from memfit.config.release import Section as _Section
from memfit.errors import ConfigError


class RunConfig(_Section):
    name: str = Field("memfit", min_length=1, max_length=100,
                      description="Run name: the MLflow run name and the Prefect flow-run name.")
    work_dir: str = Field("runs/work", description="Scratch folder for preset models and caches.")


class ModelConfig(_Section):
    name_or_path: str | None = Field(
        None, description="A local Hugging Face causal-LM folder or a hub id, loaded with from_pretrained. "
        "Overrides `preset` when set.")
    preset: Literal["tiny-llama", "tiny-gpt2"] | None = Field(
        "tiny-llama", description="A tiny model built from a config with random weights (used when "
        "name_or_path is unset); saved locally first and loaded through from_pretrained.")
    vocab_size: int = Field(512, ge=64, le=65536, description="Preset only: BPE vocabulary size.")
    hidden_size: int = Field(64, ge=8, le=8192, description="Preset only: hidden size.")
    num_layers: int = Field(2, ge=1, le=128, description="Preset only: number of decoder blocks.")
    num_heads: int = Field(4, ge=1, le=128, description="Preset only: attention heads.")
    max_position_embeddings: int = Field(512, ge=16, description="Preset only: longest sequence.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model folder/hub.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.name_or_path is None and self.preset is None:
            raise ValueError("set model.name_or_path (a folder or hub id) or model.preset")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                             f"model.num_heads ({self.num_heads})")
        return self


class TrainConfig(_Section):
    objective: Literal["sft", "dpo"] = Field(
        "sft", description="What the step optimises. sft: next-token loss (memory.loss); dpo: the preference "
        "loss of the dpo section on data.format preference pairs, from the full logits of chosen and rejected in "
        "one forward (memory.loss does not apply; docs/preference.md).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train for.")
    batch_size: int = Field(8, ge=1, description="Sequences per optimizer step (the global batch).")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step; must divide batch_size.")
    lr: float = Field(3e-4, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before the cosine decay.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Gradient clipping norm; null disables.")
    seed: int = Field(42, description="Seed for weights init, data order and dropout.")
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"] = Field(
        "fp32", description="Numeric precision of the training step.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present, else CPU.")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads; pinned so CPU runs repeat bitwise. "
                                "Default: OMP_NUM_THREADS if set, else the cores (split among a node's ranks), max 4.")
    compile: bool = Field(
        False, description="torch.compile each decoder block in place (regional compilation): faster steps once "
        "compiled, at a compile cost on the first step of every process (logged apart as the compile_s metric; a "
        "resumed run compiles again). Off by default: bench/sft_peers.py --compile measures whether it pays.")
    log_every_steps: int = Field(1, ge=1, description="Metrics are recorded every N optimizer steps.")
    eval_batches: int = Field(8, ge=1, description="Validation micro-batches used for loss/perplexity.")

    @model_validator(mode="after")
    def _accum_divides(self) -> TrainConfig:
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"train.grad_accum_steps ({self.grad_accum_steps}) must divide "
                             f"train.batch_size ({self.batch_size}): the micro-batch is their quotient")
        return self

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum_steps


class MemoryConfig(_Section):
    policy: Literal["auto", "none", "full", "every_k", "selective", "offload"] = Field(
        "auto", description="Gradient checkpointing policy. auto: the planner estimates every candidate stack "
        "and picks the fastest that fits the budget (it may mix kinds per block). selective saves matmul/"
        "attention outputs and recomputes the rest; offload (GPU only) keeps the checkpointed inputs in pinned "
        "CPU memory. A fixed policy overrides the planner.")
    every_k: int = Field(2, ge=1, description="every_k: checkpoint one decoder block in every k (blocks 0, k, 2k...).")
    selective_save_ops: list[str] = Field(
        default_factory=lambda: ["mm", "addmm", "bmm", "_scaled_dot_product_efficient_attention",
                                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                                 "_scaled_dot_product_flash_attention_for_cpu"],
        description="selective: aten ops whose outputs are saved; every other op inside a block is recomputed.")
    block_class: str | None = Field(
        None, description="Class name of the decoder block to checkpoint (e.g. LlamaDecoderLayer), for models "
        "whose block list memfit does not find by itself. Unset: found automatically.")
    budget_gb: float | None = Field(
        None, gt=0.0, description="Memory budget in GB (1e9 bytes) for the training step's tensors; on CPU a "
        "simulated budget. Unset: memory.device's usable memory, else the device's free memory.")
    device: str | None = Field(
        None, description="Target device profile the plan is made for: a100-40gb, a100-80gb, h100-80gb, h200, "
        "l4, l40s, rtx-4090, t4 or cpu. Unset: the device this run is on.")
    safety_margin: float = Field(
        0.05, ge=0.0, lt=0.5, description="Share of the budget the planner leaves free for allocator "
        "fragmentation and estimate error.")
    allow_precisions: list[Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"]] = Field(
        default_factory=list, description="Planner: other train.precision values it may fall back to when no "
        "stack fits at train.precision. Empty: train.precision only.")
    allow_smaller_micro_batch: bool = Field(
        True, description="Planner: may lower the micro-batch (raising the accumulation steps, same global "
        "batch) when that is the cheapest way to fit.")
    loss: Literal["auto", "plain", "chunked", "fused"] = Field(
        "auto", description="How the LM head and cross-entropy run. plain: full [batch, seq, vocab] logits (what "
        "transformers does); chunked: head and loss per chunk of memory.loss_chunk_tokens tokens, recomputed in "
        "backward, so no full-vocabulary logits are ever alive; fused: Liger's fused linear cross-entropy (CUDA, "
        "pip install liger-kernel): chunked without the recompute, the gradients made in forward (elsewhere one "
        "line says why and the next best runs). auto: the memory planner's choice where it searches, else from "
        "32768 vocabulary entries on fused on CUDA with liger-kernel, else chunked; below that plain. "
        "train.objective dpo: plain (its log-probs come from the logits; chunked and fused are refused).")
    loss_chunk_tokens: int = Field(
        1024, ge=16, le=1_048_576, description="chunked loss: tokens per chunk of the LM head and cross-entropy.")
    optimizer: Literal["auto", "adamw", "adamw-fused", "adamw-8bit", "adamw-cpu-offload"] = Field(
        "auto", description="AdamW implementation. adamw: torch's default path (foreach on CUDA, with scratch "
        "copies); adamw-fused: one fused kernel, no scratch; adamw-8bit: bitsandbytes' 8-bit blockwise state "
        "(pip install bitsandbytes); adamw-cpu-offload (CUDA only): state and step on the CPU, torchao's "
        "CPUOffloadOptimizer (pip install torchao). auto: adamw-fused on CUDA, adamw on CPU (the pinned golden "
        "losses were made with it).")
    optimizer_in_backward: bool | Literal["auto"] = Field(
        False, description="Step each parameter in backward as soon as its gradient is accumulated, and free "
        "that gradient (no full set of gradients alive). Needs train.grad_accum_steps 1, train.max_grad_norm "
        "null (a global clip needs every gradient first) and no fp16-mixed; one process only. With "
        "adamw-cpu-offload each gradient moves to host memory as it is accumulated and the CPU steps after "
        "backward. auto: off unless the planner turns it on.")
    lean_layers: bool | Literal["auto"] = Field(
        "auto", description="SwiGLU MLPs and Llama-style RMSNorms (Llama, Mistral, Qwen2/3...) as memory-lean "
        "autograd functions: the MLP saves its two projections, not the activation too, and its backward writes "
        "the gradients into them; the norm saves its 16-bit input, not an fp32 copy. Same math; layers of "
        "other shapes are left as they are. auto: tried by the planner in a tier that fits nowhere without them, and "
        "beside a tier that fits only with recompute (where they may let fewer blocks recompute, the faster wins) "
        "(memory.policy auto, or lora.enabled auto); off under a fixed policy.")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from memfit.config.devices import normalise_device_name

        return normalise_device_name(v, "memory.device")


class LoraConfig(_Section):
    enabled: bool | Literal["auto"] = Field(
        False, description="Train LoRA adapters (through peft) instead of all weights. auto: only when no "
        "full fine-tuning stack fits the memory budget. Adapters are merged into the weights before export.")
    r: int = Field(8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator (the update is scaled by alpha/r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch input.")
    target_modules: list[str] | Literal["all-linear", "attention", "attention-mlp", "attention-experts"] = Field(
        "all-linear", description="Module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj], or a "
        "preset. all-linear: every linear layer but the output head (on a mixture of experts, peft's adapters on "
        "the routed experts' weights too); attention: the attention projections; attention-mlp: those and the "
        "dense MLP layers (shared experts, dense layers), not the routed experts; attention-experts: attention and "
        "the routed experts' fused weights (peft's target_parameters). An MoE router is never adapted.")
    quantize: Literal["none", "nf4"] = Field(
        "none", description="QLoRA: nf4 holds the frozen base's linear layers in 4-bit NF4 with double "
        "quantization (bitsandbytes; compute in train.precision); the export dequantizes and merges into a "
        "plain model. Needs LoRA (lora.enabled true or auto); with auto the planner uses it only when no "
        "stack fits without it.")

    @model_validator(mode="after")
    def _quantize_needs_lora(self) -> LoraConfig:
        if self.quantize != "none" and self.enabled is False:
            raise ValueError(f"lora.quantize={self.quantize} quantizes the frozen base, which only LoRA has: "
                             "set lora.enabled=true (or auto), or lora.quantize=none")
        return self

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and not v:
            raise ValueError("lora.target_modules is empty; name the modules to adapt or use all-linear")
        return v


class SpotWatcherConfig(_Section):
    """Polling the cloud's instance metadata for a spot interruption notice (AWS gives 2 minutes)."""

    enabled: bool | None = Field(
        None, description="Watch for a spot interruption notice and stop as on SIGTERM (finish the step, save, "
        "exit 75). null: $MEMFIT_SPOT_WATCHER (true/false), else off.")
    metadata_url: str | None = Field(
        None, description="Base URL of the instance metadata service, with or without /latest. "
        "null: $MEMFIT_SPOT_METADATA_URL, else AWS IMDS http://169.254.169.254/latest/.")
    poll_seconds: float = Field(5.0, gt=0.0, le=60.0, description="Seconds between polls (AWS suggests 5).")
    timeout_seconds: float = Field(1.0, gt=0.0, le=30.0, description="Timeout of each metadata request.")
    imdsv2: bool = Field(True, description="Take an IMDSv2 session token (PUT api/token) first; without one "
                         "(PUT refused) the watcher falls back to IMDSv1 GETs.")
    on_rebalance: Literal["save", "stop", "ignore"] = Field(
        "save", description="A rebalance recommendation (higher interruption risk, before any notice): save a "
        "training checkpoint now and go on, stop as on a notice, or only log it.")

    @field_validator("metadata_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://169.254.169.254/latest/")
        return v

class MonitorConfig(_Section):
    """Memory readings while training, a warning before the limit, and an optional clean stop at it."""

    enabled: bool = Field(True, description="Record memory (MLflow metrics memory/*, the progress line) and warn.")
    every_steps: int = Field(10, ge=1, description="Read memory at the first step and every N optimizer steps.")
    warn_fraction: float = Field(0.9, gt=0.0, le=1.0, description="Warn once (log, MLflow tag, Prefect event) when "
                                 "the peak passes this fraction of the budget (memory.budget_gb, else the "
                                 "device's memory).")
    stop_at_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="Stop cleanly with a training checkpoint (exit code 76) when the peak "
        "passes this fraction of the budget; unset: never stop.")
    track_tensors: bool = Field(True, description="CPU: count live tensor bytes (the figure the probe reports, "
                                "compared with memory.budget_gb) on the steps monitor.count_every_steps says; off: "
                                "RSS growth since the start.")
    count_every_steps: int = Field(
        100, ge=1, description="CPU with track_tensors: count live tensor bytes on steps 1 and 2 and every N steps "
        "(counting runs the step through a Python dispatch mode, ≈ 1.2-1.6x slower); readings in between report "
        "the last counted peak (the same shapes reach the same peak each step).")


class CheckpointConfig(_Section):
    uri: str = Field("runs/checkpoints", description="Where training checkpoints go: a local folder "
                     "or s3://bucket/prefix.")
    every_steps: int = Field(50, ge=1, description="Save a training checkpoint every N optimizer steps.")
    keep_last: int = Field(2, ge=1, description="Complete training checkpoints to keep.")
    resume: bool = Field(True, description="Resume from the newest complete training checkpoint at uri.")
    grace_seconds: float = Field(
        30.0, gt=0, description="Time a preemption notice leaves to save (Kubernetes "
        "terminationGracePeriodSeconds, 120 s on AWS spot); a warning says when a save took longer.")
    endpoint_url: str | None = Field(
        None, description="s3:// only: an S3-compatible endpoint (MinIO, Ceph, moto). null: $AWS_ENDPOINT_URL_S3 "
        "or $AWS_ENDPOINT_URL, else AWS. Credentials never go in the config: boto3 reads AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance/pod role.")
    region: str | None = Field(None, description="s3:// only: the bucket's region. null: $AWS_REGION, "
                               "$AWS_DEFAULT_REGION or the profile.")
    multipart_threshold_mb: int = Field(64, ge=5, le=5120, description="s3:// only: files larger than this "
                                        "go up in parts of this size, each part retried on its own.")
    on_busy: Literal["wait", "skip"] = Field(
        "wait", description="A periodic save due while the previous one is still uploading: wait for it "
        "(training stalls) or skip this one; either is logged. Final and preemption saves always wait.")
    upload_attempts: int = Field(
        3, ge=1, le=20, description="Attempts of a whole save (upload, then manifest) on top of botocore's "
        "per-request retries (which ride out ~15 s): an S3 outage longer than that is retried with backoff.")
    retry_backoff_seconds: float = Field(5.0, ge=0.0, le=600.0,
                                         description="Wait before the 2nd save attempt; doubles each time.")
    spot: SpotWatcherConfig = Field(default_factory=SpotWatcherConfig)

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://minio:9000")
        if "@" in v.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("must not hold credentials (user:secret@host); set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY in the environment instead")
        return v


class TrackingConfig(_Section):
    backend: Literal["mlflow", "null"] = Field("mlflow", description="Experiment tracker; null records nothing.")
    uri: str | None = Field(None, description="MLflow tracking URI. Unset: $MLFLOW_TRACKING_URI, "
                            "else sqlite:///mlflow.db in the working folder.")
    experiment: str = Field("memfit", min_length=1, description="MLflow experiment name.")
    fail_if_unreachable: bool = Field(True, description="An unreachable tracking server fails the run before any work "
                           "(naming the URI); false: warn and continue with the null tracker.")
    missing_run: Literal["new_run", "error"] = Field(
        "new_run", description="When the MLflow run a training checkpoint names is not in this store (a spot "
        "restart on a new machine with its own local store): new_run trains on into a new run tagged "
        "memfit.resumed_from_run_id and memfit.resumed_from_step, with a warning; error stops instead. Keep one "
        "run across machines with a shared tracking server (tracking.uri=http://...).")
    system_metrics: bool = Field(True, description="Log MLflow system metrics (CPU, memory, disk, network; "
                                 "GPU through pynvml when installed) as system/* metrics.")
    system_metrics_interval_s: float = Field(
        10.0, ge=0.1, le=3600, description="Seconds between system-metric samples; use ~1 for short runs. "
        "$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it.")

    @field_validator("backend", mode="before")
    @classmethod
    def _yaml_null(cls, v: Any) -> Any:
        # `backend: null` in YAML (or --set tracking.backend=null) parses to None: it means the null tracker.
        return "null" if v is None else v

    def resolved_uri(self) -> str:
        if self.uri:
            return self.uri
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if env:
            return env
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


class DistributedConfig(_Section):
    """Several processes (GPUs, nodes) training one model; 1 process in all is today's single-process path."""

    nproc_per_node: int = Field(1, ge=1, le=1024, description="Training processes on this machine (one per GPU); "
                                "above 1 (or with nnodes above 1) training runs under torchrun.")
    nnodes: int = Field(1, ge=1, le=4096, description="Machines taking part; each runs `memfit launch-node` "
                        "(node 0 runs the flow).")
    node_rank: int = Field(0, ge=0, description="This machine's index, 0..nnodes-1 (node 0 runs the flow).")
    rdzv_backend: Literal["c10d", "static"] = Field(
        "c10d", description="torchrun rendezvous: c10d (node 0 hosts it at rdzv_endpoint) or static "
        "(fixed master address and node ranks).")
    rdzv_endpoint: str | None = Field(
        None, description="host:port every node reaches node 0 at (required with nnodes above 1); unset with one "
        "node: torchrun --standalone picks a free local port.")
    rdzv_id: str | None = Field(None, description="Rendezvous id shared by the nodes of one job. Unset: run.name.")
    strategy: Literal["auto", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = Field(
        "auto", description="How the ranks divide the work: ddp replicates the model; fsdp2 shards parameters, "
        "gradients and optimizer state (fully_shard per decoder block); deepspeed_zero2 shards gradients and "
        "optimizer state, deepspeed_zero3 also parameters (pip install memfit[deepspeed]). auto: ddp when a "
        "full replica fits the memory budget, else fsdp2.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="Collective backend; auto: nccl on CUDA, "
                                                     "gloo on CPU.")
    offload_optimizer: bool = Field(False, description="deepspeed_zero2/3 only: keep the optimizer state in CPU "
                                    "memory (ZeRO-Offload) to fit larger models at some speed cost.")
    timeout_minutes: float = Field(30.0, gt=0, description="A collective (or a rank's training-checkpoint upload) "
                                   "that waits longer than this fails the run instead of hanging.")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"distributed.node_rank ({self.node_rank}) must be below distributed.nnodes "
                             f"({self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("distributed.rdzv_endpoint: set host:port of node 0 (reachable from every node) "
                             f"when distributed.nnodes={self.nnodes}")
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"distributed.rdzv_endpoint: {self.rdzv_endpoint!r} is not host:port "
                                 "(e.g. 10.0.0.1:29400)")
        if self.offload_optimizer and not self.strategy.startswith("deepspeed"):
            raise ValueError("distributed.offload_optimizer needs distributed.strategy deepspeed_zero2 or "
                             f"deepspeed_zero3 (got {self.strategy})")
        return self


class MemfitConfig(_Section):
    """The whole config tree: every YAML in configs/ and every flow parameter is one of these."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _micro_batch_splits(self) -> MemfitConfig:
        # Each rank takes an equal slice of every global micro-batch, so losses match one process.
        world, micro = self.distributed.world_size, self.train.micro_batch_size
        if micro % world:
            raise ValueError(f"train.batch_size / train.grad_accum_steps = {micro} sequences per micro-batch "
                             f"must divide evenly across distributed.nproc_per_node x nnodes = {world} ranks; "
                             "change train.batch_size or train.grad_accum_steps")
        return self

    @model_validator(mode="after")
    def _objective_fits(self) -> MemfitConfig:
        dpo, fmt = self.train.objective == "dpo", self.data.format
        if dpo and fmt not in ("auto", "preference"):
            raise ValueError(f"train.objective: dpo trains on preference pairs, and data.format is {fmt}; set "
                             "data.format: preference (or auto)")
        if not dpo and fmt == "preference":
            raise ValueError("data.format: preference pairs need train.objective: dpo")
        gated = [k for k in self.eval.gate.metrics if k.partition("/")[0] == "preference"]
        if gated and not dpo:
            raise ValueError(f"eval.gate.metrics: {gated[0]!r} is scored on held-out preference pairs, and "
                             "train.objective is sft; drop the rule or train with train.objective: dpo")
        if not dpo:
            return self
        if self.memory.loss in ("chunked", "fused"):
            raise ValueError(f"memory.loss: {self.memory.loss} is a next-token loss, and train.objective dpo takes "
                             "its log-probs from the logits the head keeps (plain); leave memory.loss auto or plain")
        if self.dpo.reference == "adapter_off" and self.lora.enabled is False:
            raise ValueError("dpo.reference: adapter_off disables the LoRA adapters for the reference, and "
                             "lora.enabled is false; enable LoRA or use dpo.reference copy or precompute")
        if self.distributed.world_size > 1 and self.distributed.strategy.startswith("deepspeed"):
            raise ValueError(f"train.objective: dpo runs under ddp and fsdp2, not {self.distributed.strategy} yet; "
                             "set distributed.strategy to ddp, fsdp2 or auto")
        if self.distributed.world_size > 1 and self.dpo.reference == "copy" and self.distributed.strategy == "fsdp2":
            raise ValueError("dpo.reference: copy is not supported with distributed.strategy fsdp2 (a frozen copy "
                             "of a sharded model); use precompute (or auto), or adapter_off with LoRA")
        return self

    @model_validator(mode="after")
    def _memory_techniques_fit(self) -> MemfitConfig:
        if self.memory.loss in ("chunked", "fused") and self.distributed.world_size > 1:
            raise ValueError(f"memory.loss: {self.memory.loss} runs in one process only (DDP/FSDP2 need the model's "
                             "own forward); set memory.loss to plain or auto")
        # A parameter stepped in backward cannot wait for the other gradients: refused where the step needs them.
        if self.memory.optimizer_in_backward is not True:
            return self
        t, d = self.train, self.distributed
        why = ("train.grad_accum_steps must be 1 (each micro-batch would step)" if t.grad_accum_steps > 1
               else "train.max_grad_norm must be null (clipping needs the global norm of every gradient first)"
               if t.max_grad_norm is not None
               else "train.precision fp16-mixed needs the loss scaler's inf check of every gradient first"
               if t.precision == "fp16-mixed"
               else "it runs in one process only (DDP, FSDP2 and DeepSpeed reduce gradients after backward)"
               if d.world_size > 1 or d.strategy not in ("auto", "ddp") else None)
        if why:
            raise ValueError(f"memory.optimizer_in_backward: true: {why}; change that or set it to false")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys → values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict) and (node or not prefix):  # an empty mapping (no gate rules) is one value
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = node

        walk("", self.model_dump(mode="json"))
        return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=c` → (['a', 'b'], parsed c); values are parsed as YAML scalars (1, 1e-3, true, null)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.max_steps=10")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {'.'.join(path[:i + 1])} is not a section")
        node = nxt
    node[path[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> None:
    """Apply `dotted.key=value` overrides to a raw config mapping in place (validated later, by from_dict)."""
    for item in overrides or []:
        keys, value = parse_override(item)
        _set_dotted(data, keys, value, f"--set {item}")


# Fields whose rejected value may hold a secret (user:password@host): the error names the field only.
_NO_ECHO = {("checkpoint", "endpoint_url")}


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `memfit config --defaults` lists every key)"
        elif "input" in e and e["type"] not in ("missing",) and e["loc"] and tuple(e["loc"]) not in _NO_ECHO:
            # (a check across sections, at the root, names its fields itself: its input is the whole tree)
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def from_dict(data: dict[str, Any], source: str = "config") -> MemfitConfig:
    try:
        return MemfitConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> MemfitConfig:
    """Defaults ← YAML file (a diff) ← `dotted.key=value` overrides, validated once at the end."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found (configs/ holds the shipped ones, e.g. configs/tiny.yaml)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, train:, ...)")
        data = copy.deepcopy(loaded)
    apply_overrides(data, overrides)
    if overrides:
        source += " + --set " + " ".join(overrides)
    return from_dict(data, source)
