"""DeepSpeed: its JSON config generated from the plan (a pure function) and a lazy, explained import."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.memory.planner.sharding import bucket_elements

INSTALL_HINT = ("DeepSpeed is not installed: pip install 'memfit[deepspeed]' (on a machine without CUDA "
                "build tools: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed), or choose "
                "distributed.strategy=fsdp2")


def import_deepspeed() -> Any:
    """`import deepspeed`, or a ConfigError that says how to install it (it is an optional extra)."""
    try:
        import deepspeed
    except ImportError as err:
        raise ConfigError(f"distributed.strategy: {INSTALL_HINT} ({err})") from None
    return deepspeed


def deepspeed_config(*, stage: int, world_size: int, batch_size: int, grad_accum_steps: int, precision: str,
                     max_grad_norm: float | None, lr: float, weight_decay: float, policy: str,
                     num_layers: int, offload_optimizer: bool = False,
                     hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config for one run: batch split, accumulation, precision, ZeRO stage, clipping.

    train.batch_size is the global batch, as everywhere in memfit: DeepSpeed checks
    train_batch_size == micro_batch_per_gpu x grad_accum x world_size, so the micro-batch per GPU is
    batch_size / grad_accum_steps / world_size. Gradient checkpointing itself is applied to the model by
    memfit's policy (transformers' per-block recompute) before DeepSpeed wraps it; the
    activation_checkpointing section mirrors the plan for DeepSpeed's own checkpointing API and CPU
    placement (offload policy).
    """
    if stage not in (2, 3):
        raise ConfigError(f"distributed.strategy: DeepSpeed ZeRO stage must be 2 or 3 (got {stage})")
    if world_size < 1 or grad_accum_steps < 1:
        raise ConfigError("DeepSpeed needs world_size >= 1 and train.grad_accum_steps >= 1")
    per_gpu, rest = divmod(batch_size, grad_accum_steps * world_size)
    if rest or per_gpu < 1:
        raise ConfigError(f"train.batch_size ({batch_size}) must be a multiple of train.grad_accum_steps "
                          f"({grad_accum_steps}) x ranks ({world_size}) for DeepSpeed")
    if precision == "bf16-true":
        raise ConfigError("train.precision=bf16-true: DeepSpeed keeps fp32 master weights; use bf16-mixed")
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "allgather_partitions": True,
    }
    if hidden_size:  # buckets sized to the model (the plan counts them: planner/sharding.py)
        buckets = bucket_elements(hidden_size)
        zero.update({"reduce_bucket_size": buckets, "allgather_bucket_size": buckets} if stage == 2 else
                    {"reduce_bucket_size": buckets, "stage3_prefetch_bucket_size": int(0.9 * buckets),
                     "stage3_param_persistence_threshold": 10 * int(hidden_size)})
    if stage == 3:
        # Export needs whole 16-bit weights on rank 0 (gathered at save time).
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": per_gpu,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": float(max_grad_norm) if max_grad_norm is not None else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16-mixed"},
        "fp16": {"enabled": precision == "fp16-mixed", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        # memfit's AdamW (betas 0.9/0.95, no decay on biases and norms via param groups); torch_adam: the
        # plain PyTorch implementation, which needs no compiled DeepSpeed ops.
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": weight_decay, "torch_adam": True}},
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": policy == "offload",
            "contiguous_memory_optimization": False,
            "number_checkpoints": num_layers if policy != "none" else None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,  # memfit logs every step itself; DeepSpeed's own prints are noise
        "wall_clock_breakdown": False,
    }
    return config


def config_for(cfg: Any, plan: Any, num_layers: int, hidden_size: int | None = None) -> dict[str, Any]:
    """deepspeed_config from a MemfitConfig and a PlanReport (strategy deepspeed_zero2 / deepspeed_zero3)."""
    stage = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}.get(plan.strategy)
    if stage is None:
        raise ConfigError(f"not a DeepSpeed strategy: {plan.strategy}")
    t = cfg.train
    return deepspeed_config(stage=stage, world_size=cfg.distributed.world_size, batch_size=t.batch_size,
                            grad_accum_steps=plan.grad_accum_steps, precision=plan.precision,
                            max_grad_norm=t.max_grad_norm, lr=t.lr, weight_decay=t.weight_decay,
                            policy=plan.policy, num_layers=num_layers,
                            offload_optimizer=cfg.distributed.offload_optimizer, hidden_size=hidden_size)
