"""The memory and LoRA sections: gradient checkpointing, the planner's budget and techniques, adapters and QLoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from memfit.config.release import Section as _Section


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
