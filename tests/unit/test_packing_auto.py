"""data.packing auto: the layout predicted fastest per trained token from the data's lengths, device and kernel."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from memfit import config
from memfit.config.devices import cpu_profile, get_profile
from memfit.data.cache import resolve_auto_packing
from memfit.data.layout import format_layouts, predict
from memfit.data.order import BatchOrder, grouped_permutation
from memfit.errors import ConfigError

pytestmark = pytest.mark.unit
LLAMA = SimpleNamespace(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=384, model_type="llama")


def _lengths(n: int, lo: int, hi: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return lengths, [n // 2 for n in lengths]


def _by_name(costs):
    return {c.packing: c for c in costs}


def test_flattened_padding_free_computes_no_padding_and_padded_rows_pay_for_theirs():
    lengths, trained = _lengths(200, 10, 250)
    costs = _by_name(predict(lengths, trained, 256, 8, LLAMA, cpu_profile(), "sdpa", allow_blocks=False,
                             flatten=True, group_by_length=False))
    assert set(costs) == {"padding_free", "none"}  # blocks is not a candidate for this objective
    assert costs["padding_free"].row()["padding_fraction"] == 0
    assert costs["padding_free"].slots == sum(lengths)
    assert costs["none"].row()["padding_fraction"] > 0.3  # lengths spread from 10 to 250, random batches
    assert costs["none"].trained == costs["padding_free"].trained == sum(trained)


def test_length_grouping_cuts_the_padding_of_one_example_a_row():
    lengths, trained = _lengths(400, 10, 250)
    plain = _by_name(predict(lengths, trained, 256, 8, LLAMA, cpu_profile(), "sdpa", False, False,
                             group_by_length=False))["none"]
    grouped = _by_name(predict(lengths, trained, 256, 8, LLAMA, cpu_profile(), "sdpa", False, False))["none"]
    assert grouped.row()["padding_fraction"] < 0.05 < 0.3 < plain.row()["padding_fraction"]
    assert grouped.seconds < plain.seconds


def test_rows_packed_but_not_flattened_pay_their_tail_padding_and_masks():
    lengths, trained = _lengths(200, 10, 250)
    costs = _by_name(predict(lengths, trained, 256, 8, LLAMA, cpu_profile(), "sdpa", False, flatten=False))
    row = costs["padding_free"]
    assert row.slots % 256 == 0 and row.slots > sum(lengths) and row.mask_bytes == row.slots * 256


def test_varlen_flash_attention_picks_padding_free_on_a_gpu():
    lengths, trained = _lengths(200, 10, 250)
    costs = predict(lengths, trained, 256, 8, LLAMA, get_profile("h100"), "flash_attention_2", allow_blocks=False,
                    flatten=True)
    assert costs[0].packing == "padding_free" and costs[0].mask_bytes == 0


def test_equal_lengths_leave_nothing_to_pack_and_per_batch_padding_wins():
    lengths, trained = [200] * 64, [100] * 64
    costs = predict(lengths, trained, 256, 8, LLAMA, cpu_profile(), "sdpa", allow_blocks=False, flatten=True)
    # Rows of one example each, no padding: none keeps the causal kernel, the flattened batch pays a mask.
    assert costs[0].packing == "none" and costs[0].mask_bytes == 0


def test_a_long_context_flattened_mask_is_priced():
    lengths, trained = _lengths(64, 500, 4000)
    costs = _by_name(predict(lengths, trained, 4096, 8, LLAMA, cpu_profile(), "sdpa", allow_blocks=False,
                             flatten=True))
    assert costs["padding_free"].mask_bytes > 8 * 4096 * 4096  # (8 rows flattened)^2, more than 8 row squares


def test_blocks_when_the_objective_allows_it():
    lengths, _ = _lengths(200, 10, 250)
    costs = _by_name(predict(lengths, [n - 1 for n in lengths], 256, 8, LLAMA, cpu_profile(), "sdpa",
                             allow_blocks=True, flatten=False))
    assert costs["blocks"].row()["padding_fraction"] == 0
    table = format_layouts("blocks", [c.row() for c in costs.values()])
    assert "| blocks | 0.0% |" in table and "| none |" in table


def test_grouped_order_is_a_permutation_resumable_at_any_batch():
    lengths = [random.Random(i).randint(1, 300) for i in range(500)]
    perm = list(range(500))
    random.Random(3).shuffle(perm)
    grouped = grouped_permutation(perm, lengths, 4)
    assert sorted(grouped) == list(range(500)) and grouped[:200] != perm[:200]
    spread = [max(lengths[i] for i in grouped[k:k + 4]) - min(lengths[i] for i in grouped[k:k + 4])
              for k in range(0, 200, 4)]
    assert max(spread) < 30  # 200 examples sorted by length in each window: neighbours are alike
    full = BatchOrder(500, 4, seed=7, lengths=lengths)
    seen = [full.next_indices() for _ in range(180)]
    part = BatchOrder(500, 4, seed=7, lengths=lengths)
    for _ in range(77):
        part.next_indices()
    resumed = BatchOrder(500, 4, seed=7, lengths=lengths)
    resumed.load_state_dict(part.state_dict())
    assert [resumed.next_indices() for _ in range(103)] == seen[77:]  # into the next epoch, too


def test_auto_is_a_packing_choice_and_needs_the_model_config():
    cfg = config.load(None, ["data.packing=auto"])
    assert cfg.data.packing == "auto"
    with pytest.raises(ConfigError, match=r"^data\.packing: auto needs the model's config"):
        resolve_auto_packing(cfg, None, "d", None, None)
    with pytest.raises(Exception, match=r"data\.packing"):
        config.load(None, ["data.packing=fastest"])
