"""Per-rank memory under DDP / FSDP2 / ZeRO: the byte arithmetic `memfit plan` shows for many GPUs."""

from __future__ import annotations

import math

import pytest

from memfit.cli.planning import format_table
from memfit.memory.planner.sharding import choose_strategy, per_rank_bytes, training_state_bytes

pytestmark = pytest.mark.unit
GB = 1e9


def llama3_8b_params() -> tuple[int, int]:
    """(total, largest block) parameter counts of Llama-3-8B from its shape (untied embeddings)."""
    hidden, inter, layers, vocab, heads, kv_heads = 4096, 14336, 32, 128256, 32, 8
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    block = attn + 3 * hidden * inter + 2 * hidden  # + gate/up/down + two RMSNorms
    return layers * block + 2 * vocab * hidden + hidden, block


def test_llama3_8b_on_8_gpus_fsdp_shards_params_grads_and_optimizer():
    n, block = llama3_8b_params()
    assert n == 8_030_261_248  # the published parameter count: the shape above is right
    s = training_state_bytes(n, "bf16-mixed")  # fp32 master weights, fp32 grads, two fp32 Adam moments
    assert (s["params"], s["grads"], s["optim"]) == (4 * n, 4 * n, 8 * n)
    acts = int(6e9)
    root, head = n - 32 * block, 128256 * 4096  # embeddings, final norm and head: one unit, 1.05 B parameters
    assert 1.05e9 < root < 1.06e9
    # In a block's backward, bf16-mixed: the root unit and three blocks gathered in bf16 (MixedPrecisionPolicy),
    # the head's unsharded bf16 gradient, one block's gradients and the reduce-scatter's input (fp32: counted so).
    fsdp = per_rank_bytes(s["params"], s["grads"], s["optim"], acts, "fsdp2", 8, block_bytes=4 * block,
                          gathered_block_bytes=2 * block, root_bytes=2 * root, root_grad_bytes=2 * head,
                          block_grad_bytes=4 * block, n_blocks=32)
    assert fsdp["params"] == math.ceil(4 * n / 8) and fsdp["optim"] == math.ceil(8 * n / 8)
    assert fsdp["transient"] == 3 * 2 * block + 2 * root + 2 * head + 2 * 4 * block
    assert fsdp["total"] == fsdp["params"] + fsdp["grads"] + fsdp["optim"] + acts + fsdp["transient"]
    assert 28 * GB < fsdp["total"] < 29 * GB  # ~16 GB of sharded state + 6 GB of activations + ~6.2 GB transient
    # Counting blocks alone, as until 2026-12-08, left out 2.1 GB of gathered root unit per rank.
    assert fsdp["transient"] - per_rank_bytes(s["params"], s["grads"], s["optim"], acts, "fsdp2", 8,
                                              block_bytes=4 * block, gathered_block_bytes=2 * block,
                                              block_grad_bytes=4 * block, n_blocks=32)["transient"] > 3 * GB
    ddp = per_rank_bytes(s["params"], s["grads"], s["optim"], acts, "ddp", 8)
    assert ddp["total"] == 16 * n + acts  # every GPU holds everything: ~134 GB, more than an 80 GB H100
    zero2 = per_rank_bytes(s["params"], s["grads"], s["optim"], acts, "deepspeed_zero2", 8)
    assert zero2["params"] == 4 * n and zero2["grads"] == math.ceil(4 * n / 8)
    strategy, why, est = choose_strategy(s["params"], s["grads"], s["optim"], acts, 8, int(80 * GB),
                                         block_bytes=4 * block)
    assert strategy == "fsdp2" and est["params"] == fsdp["params"] and "80.00 GB" in why
    table = format_table([ddp, zero2, fsdp])
    assert "fsdp2" in table and f"{fsdp['total'] / GB:.2f}" in table


def test_more_ranks_means_less_per_rank_only_for_sharded_parts():
    a = per_rank_bytes(800, 800, 1600, 100, "fsdp2", 2)
    b = per_rank_bytes(800, 800, 1600, 100, "fsdp2", 4)
    assert (a["params"], b["params"]) == (400, 200) and a["activations"] == b["activations"] == 100
    assert per_rank_bytes(800, 800, 1600, 100, "ddp", 4)["total"] == 3300
    # Shards are padded to equal size: 1001 bytes over 4 ranks is 251 each.
    assert per_rank_bytes(1001, 0, 0, 0, "fsdp2", 4)["params"] == 251


def test_deepspeed_offload_moves_optimizer_state_to_cpu():
    est = per_rank_bytes(800, 800, 1600, 0, "deepspeed_zero3", 4, offload_optimizer=True)
    assert est["optim"] == 0 and est["cpu_offload"] == 400 and est["total"] == 200 + 200


def test_ddp_when_a_replica_fits_and_single_for_one_process():
    assert choose_strategy(100, 100, 200, 50, 4, 1000)[0] == "ddp"
    assert choose_strategy(100, 100, 200, 50, 4, None)[0] == "ddp"
    assert choose_strategy(100, 100, 200, 50, 1, 10)[0] == "single"
    strategy, why, _ = choose_strategy(10**9, 10**9, 2 * 10**9, 0, 2, 10**6)
    assert strategy == "fsdp2" and "offload_optimizer" in why  # nothing fits: says what to try


def test_a_dpo_reference_copy_is_whole_on_replicas_and_absent_where_weights_are_split():
    # A frozen copy of the module is never sharded; fsdp2 / ZeRO-3 precompute the reference instead.
    rows = {s: per_rank_bytes(800, 800, 1600, 100, s, 4, reference_bytes=800)
            for s in ("ddp", "deepspeed_zero2", "fsdp2", "deepspeed_zero3")}
    assert [rows[s]["reference"] for s in rows] == [800, 800, 0, 0]
    assert rows["ddp"]["total"] == 800 + 800 + 1600 + 100 + 800
    assert rows["deepspeed_zero2"]["total"] == 800 + 200 + 400 + 100 + 800
    assert rows["fsdp2"]["total"] == per_rank_bytes(800, 800, 1600, 100, "fsdp2", 4)["total"]
    assert "ref." in format_table(list(rows.values()))
    # The copy alone tips a replica over the budget: auto shards (and precomputes) instead.
    assert choose_strategy(800, 800, 1600, 100, 4, 3500)[0] == "ddp"
    assert choose_strategy(800, 800, 1600, 100, 4, 3500, reference_bytes=800)[0] == "fsdp2"
    # Unless the config asks for a copy: then a replica it is, with the way out in the reason.
    strategy, why, est = choose_strategy(800, 800, 1600, 100, 4, 3500, reference_bytes=800, reference_copy_set=True)
    assert strategy == "ddp" and est["total"] == 4100 and "deepspeed_zero2" in why


def _estimate(moments, kinds=("none", "none"), precision="fp32"):
    from memfit.memory.estimator.compose import Estimate, Stack

    _, peak = max(moments, key=lambda pv: sum(pv[1].values()))
    return Estimate(stack=Stack(precision, 4, 1, False), kinds=kinds, policy="none", every_k=None,
                    peak_bytes=sum(peak.values()), breakdown=dict(peak), activation_bytes=0, peak_at="optimizer step",
                    step_seconds=1.0, host_bytes=0, weight_bytes=100, n_params=25, n_trainable=25, moments=moments)


# One process peaks at the optimizer step (full gradients, moments and AdamW's gradient-sized scratch: 500 B). The end
# of the forward holds 450 B, a third of it activations, which no strategy divides; the loss's own backward 480 B, with
# the loss's gradient (60 B of `other`), which no strategy divides either, and no parameter's gradient yet; the
# backward's last moment 470 B, with 40 B of gradients made.
STEP = ("step", {"params": 100, "grads": 100, "optimizer": 200, "activations": 0, "other": 100})
FORWARD = ("forward", {"params": 100, "grads": 0, "optimizer": 200, "activations": 150, "other": 0})
BACKWARD = ("backward", {"params": 100, "grads": 0, "optimizer": 200, "activations": 120, "other": 60})
LATER = ("backward", {"params": 100, "grads": 40, "optimizer": 200, "activations": 100, "other": 30})


def test_a_rank_peaks_where_its_share_does_not_where_one_process_does():
    from memfit.memory.planner.sharding import rank_share

    e = _estimate([FORWARD, BACKWARD, LATER, STEP], kinds=("none",) * 4)
    ddp = rank_share(e, strategy="ddp", world_size=4, limit=None)
    # A replica: the process's own peak, and DDP's gradient-sized buckets (100 B) beside it.
    assert ddp.peak_bytes == 600 and ddp.breakdown == dict(STEP[1], other=200)
    fsdp = rank_share(e, strategy="fsdp2", world_size=4, limit=None)
    # FSDP2 gathers three 25 B blocks (computing, prefetched, kept after forward) and, once the loss's backward is
    # done, holds two blocks' unsharded gradients (25 B each). At the step: 25 + 50 + 50 + 75 = 200 B. At the
    # forward's end: 25 + 50 + 150 + 75 = 300 B. In the loss's backward: 25 + 50 + 180 + 75 = 330 B. At the
    # backward's last moment: 25 + 10 + 50 + 130 + 75 + 50 = 340 B, the rank's peak.
    assert fsdp.peak_bytes == 340 and fsdp.breakdown["activations"] == 130
    assert fsdp.extra["ranks"]["strategy"] == "fsdp2" and fsdp.moments == []
    # auto: ddp within the limit, else fsdp2; the stack keeps the global micro-batch it was asked about
    assert rank_share(e, strategy="auto", world_size=4, limit=600).extra["ranks"]["strategy"] == "ddp"
    auto = rank_share(e, strategy="auto", world_size=4, limit=599)
    assert auto.extra["ranks"]["strategy"] == "fsdp2" and auto.peak_bytes == 340
    assert auto.stack.micro_batch_size == 4
    # bf16-mixed: FSDP2 gathers the weights in bf16 (its MixedPrecisionPolicy): three 12 B blocks.
    bf16 = rank_share(_estimate([FORWARD, BACKWARD, LATER, STEP], ("none",) * 4, "bf16-mixed"), strategy="fsdp2",
                      world_size=4, limit=None)
    assert bf16.peak_bytes == 25 + 10 + 50 + 130 + 3 * 12 + 2 * 25


def test_fsdp2_keeps_its_root_unit_gathered_and_the_heads_gradient_after_the_loss():
    from memfit.memory.planner.sharding import rank_peak

    # 100 B of weights: four 15 B blocks and a 40 B root unit (embeddings, head: 20 B each). Gathered all step: the
    # root and three blocks, 85 B. The head's gradient (20 B) from the loss's backward on; the embeddings' too at
    # the backward's last moment; two blocks' gradients (15 B each) after the loss's own backward.
    moments = [FORWARD, BACKWARD, LATER, STEP]
    row = rank_peak(moments, "fsdp2", 4, 4, trained=100, block_fraction=0.15, head_fraction=0.2)
    assert row["transient"] == 40 + 3 * 15 + 40 + 2 * 15 and row["activations"] == 130  # the last moment
    loss = rank_peak(moments[:2], "fsdp2", 4, 4, trained=100, block_fraction=0.15, head_fraction=0.2)
    assert loss["transient"] == 40 + 3 * 15  # no gradient yet: the loss's backward comes first
    middle = rank_peak([*moments[:3], LATER, STEP], "fsdp2", 4, 4, trained=100, block_fraction=0.15,
                       head_fraction=0.2)
    assert middle["transient"] == 40 + 3 * 15 + 20 + 2 * 15 + 20  # the first LATER: the head's gradient alone
    # Two blocks: no more are counted as gathered than exist.
    assert rank_peak(moments[:2], "fsdp2", 4, 2, trained=100, block_fraction=0.3)["transient"] == 40 + 2 * 30


def test_what_a_moment_holds_besides_its_state_divides_only_at_the_optimizer_step():
    from memfit.memory.planner.sharding import rank_parts, rank_peak, rank_share

    # The step's scratch is AdamW's, per parameter: a rank steps its shard. The backward's is the loss's gradient,
    # activation gradients and a checkpointed block's recompute: each rank's own micro-batch, whole on every rank.
    assert rank_parts(STEP[1], "step") == (100, 200, 200, 0)
    assert rank_parts(BACKWARD[1], "backward") == (100, 0, 200, 180)
    # A ZeRO-2 rank (gradients and optimizer state divided, an fp32 copy of its partition; no DeepSpeed buckets
    # here) in the loss's backward: 100 + 0 + 50 + 25 + 180 = 355 B. Counted as gradients the 60 B would be 15.
    zero2 = rank_share(_estimate([FORWARD, BACKWARD, STEP]), strategy="deepspeed_zero2", world_size=4, limit=None)
    assert zero2.peak_bytes == 355 and zero2.breakdown["activations"] == 180 and zero2.breakdown["grads"] == 0
    # After the loss's own backward, DeepSpeed allocates the gradient partition whole at the first reduce (25 B).
    later = rank_peak([FORWARD, BACKWARD, BACKWARD, STEP], "deepspeed_zero2", 4, 4, trained=100)
    assert later["total"] == 355 + 25 and later["grads"] == 25


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "zero9"}, "unknown strategy"),
    ({"strategy": "fsdp2", "world_size": 0}, "world_size"),
    ({"strategy": "single", "world_size": 2}, "one process"),
    ({"strategy": "fsdp2", "offload_optimizer": True}, "DeepSpeed"),
    ({"strategy": "ddp", "params": -1}, "params"),
    ({"strategy": "ddp", "reference_bytes": -1}, "reference_bytes"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    args = {"params": 1, "grads": 1, "optim": 1, "activations": 1, "strategy": "ddp", "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        per_rank_bytes(**args)


def test_bf16_true_halves_everything_and_frozen_params_cost_only_weights():
    assert training_state_bytes(10, "bf16-true") == {"params": 20, "grads": 20, "optim": 40}
    assert training_state_bytes(10, "fp32", n_frozen=90) == {"params": 400, "grads": 40, "optim": 80}
    with pytest.raises(ValueError):
        training_state_bytes(10, "int3")


def test_deepspeed_under_bf16_mixed_is_counted_from_the_model_held_in_bf16():
    from dataclasses import replace

    from memfit.memory.planner.sharding import rank_share

    # bf16-mixed as traced: fp32 weights (100 B), gradients (100 B) and moments (200 B) under autocast. DeepSpeed
    # instead converts the module to bf16: the step traced in bf16-true holds 50 B of weights, 50 B of gradients and
    # bf16 moments (100 B), which its own fp32 AdamW replaces by 200 B.
    # Activations in bf16 too: 100 B at the forward's end, 80 B in the loss's backward (autocast: 150 and 120).
    mixed = _estimate([FORWARD, BACKWARD, STEP], ("none",) * 4, "bf16-mixed")
    half = {"params": 50, "grads": 50, "optimizer": 100, "activations": 0, "other": 50}
    true = _estimate([("forward", dict(FORWARD[1], params=50, optimizer=100, activations=100)),
                      ("backward", dict(BACKWARD[1], params=50, optimizer=100, activations=80)), ("step", half)],
                     ("none",) * 4, "bf16-true")
    asked = []

    def bf16_model(e):
        asked.append(e.stack.precision)
        return replace(true, stack=replace(e.stack, precision="bf16-true"))

    rows = rank_share(mixed, strategy="deepspeed_zero2", world_size=4, limit=None,
                      bf16_model=bf16_model).extra["ranks"]["rows"]
    assert asked == ["bf16-mixed"]
    z2 = rows["deepspeed_zero2"]
    # In the loss's backward: bf16 weights whole (50), no gradient yet, fp32 moments (200 / 4 = 50) and the fp32
    # master partition (100 / 4 = 25), the bf16 activations and the loss's gradient (80 + 60).
    assert (z2["params"], z2["grads"], z2["optim"], z2["activations"]) == (50, 0, 75, 140)
    assert z2["total"] == 50 + 0 + 75 + 140
    # ddp keeps fp32 weights under autocast: its rows come from the bf16-mixed trace. FSDP2 computes in bf16
    # throughout (its residual stream too): the bf16 trace's activations, fp32 sharded state (25 + 0 + 50), three
    # blocks gathered in bf16 (3 x 12).
    plain = rank_share(mixed, strategy="deepspeed_zero2", world_size=4, limit=None).extra["ranks"]["rows"]
    assert rows["ddp"] == plain["ddp"] and plain["fsdp2"]["activations"] == 180
    assert rows["fsdp2"]["activations"] == 140 and rows["fsdp2"]["total"] == 25 + 0 + 50 + 140 + 3 * 12
    assert plain["deepspeed_zero2"]["total"] > z2["total"]


def test_zero3_keeps_fetched_weights_gathered_up_to_its_live_limit():
    from memfit.memory.planner.sharding import rank_peak

    # ZeRO-3 keeps a fetched parameter while its next use is near, up to stage3_max_live_parameters: measured on two
    # CPU ranks, a resumed rank held the whole tiny model gathered at every step's peak. Four 15 B blocks and a 40 B
    # root: all 100 B within the limit; half of them where the limit is half the model's parameters.
    moments = [FORWARD, BACKWARD, STEP]
    whole = rank_peak(moments, "deepspeed_zero3", 4, 4, trained=100, block_fraction=0.15, live_fraction=1.0)
    assert whole["transient"] == 100  # the loss's backward: no gradient yet
    assert rank_peak(moments, "deepspeed_zero3", 4, 4, trained=100, block_fraction=0.15,
                     live_fraction=0.5)["transient"] == 50


def test_zero3_with_its_blocks_unknown_counts_two_gathered_blocks():
    # The per-rank path from phase 1's probe (plans saved before the planner planned ranks) knows neither the
    # blocks nor the live limit: two blocks' weights and one block's gradients, not every block it cannot count.
    row = per_rank_bytes(800, 800, 1600, 100, "deepspeed_zero3", 4, block_bytes=100)
    assert row["transient"] == 2 * 100 + 100
    assert row["total"] == 200 + 200 + 400 + 100 + row["transient"]  # (no trained_bytes: no fp32 partition)
