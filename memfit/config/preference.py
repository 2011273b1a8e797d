"""The preference-tuning section: DPO's loss (sigmoid, ipo, reference-free simpo) and its reference log-probs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from memfit.config.release import Section


class DpoConfig(Section):
    """train.objective: dpo. The names follow TRL's DPOConfig / CPOConfig, so a TRL recipe's values carry over."""

    beta: float = Field(
        0.1, gt=0.0, le=100.0, description="Strength of the preference against the reference: the implicit "
        "reward is beta x (policy - reference) log-probability of a completion (simpo: beta x the policy's "
        "mean log-probability per completion token). TRL's default 0.1; SimPO papers use 2.0-2.5.")
    loss_type: Literal["sigmoid", "ipo", "simpo"] = Field(
        "sigmoid", description="sigmoid: the DPO paper's -log sigmoid(beta x margin) on summed completion "
        "log-probs; ipo: (margin - 1/(2 beta))^2 on log-probs averaged per completion token (IPO paper, as TRL); "
        "simpo: reference-free, -log sigmoid(beta x (mean log-prob chosen - rejected) - simpo_gamma) (TRL's "
        "CPO loss_type simpo without the SFT term). No reference model is used with simpo.")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="sigmoid and simpo: the share of pairs assumed mislabelled (conservative "
        "DPO, cDPO): the loss mixes in the flipped pair with this weight, as TRL's CPO and earlier DPO trainers "
        "(TRL 1.16's DPO sigmoid ignores it). 0: plain DPO.")
    simpo_gamma: float = Field(
        0.5, ge=0.0, description="simpo: the target reward margin gamma, in reward units: the loss is -log "
        "sigmoid(beta x (mean log-prob chosen - rejected) - simpo_gamma), as TRL's CPOConfig simpo_gamma.")
    reference: Literal["auto", "adapter_off", "copy", "precompute"] = Field(
        "auto", description="Where the reference log-probs come from (sigmoid, ipo). adapter_off: the same "
        "model with its LoRA adapters disabled (no extra weights; needs lora.enabled); copy: a frozen copy of "
        "the starting model in memory (its weights again, an extra forward a step); precompute: one pass over "
        "the training and validation pairs before the first step stores them beside the data (no reference "
        "model while training). auto: precompute when max_steps x pairs a step cover the training pairs at least "
        "once (each pair's reference computed once instead of every pass), else adapter_off with LoRA, else copy "
        "(precompute where the ranks each hold a slice of the weights: fsdp2, deepspeed_zero3, where copy is an "
        "error).")
