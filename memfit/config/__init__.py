"""The typed config tree: defaults here, YAML files in configs/ are diffs, `--set a.b=c` on top."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from memfit.config.checkpoint import CheckpointConfig, MonitorConfig
from memfit.config.data import DataConfig
from memfit.config.memory import LoraConfig, MemoryConfig
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
        # Parameters split over the ranks (planner/sharding.splits_parameters; config sits below the planner).
        sharded = self.distributed.strategy in ("fsdp2", "deepspeed_zero3")
        if self.distributed.world_size > 1 and self.dpo.reference == "copy" and sharded:
            raise ValueError(f"dpo.reference: copy is not supported with distributed.strategy "
                             f"{self.distributed.strategy} (a frozen copy of a sharded model); use precompute (or "
                             "auto), or adapter_off with LoRA")
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
