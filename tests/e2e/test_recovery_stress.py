"""The three-preemption chain again and again (bench/recovery_stress.sh runs it beside the suite): a race in
draining, claiming or restarting shows up as one failed round. Skipped unless MEMFIT_STRESS_ROUNDS is set."""

from __future__ import annotations

import os

import pytest
from recovery_support import preemption_chain

ROUNDS = int(os.environ.get("MEMFIT_STRESS_ROUNDS") or 0)
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.stress,
              pytest.mark.skipif(not ROUNDS, reason="set MEMFIT_STRESS_ROUNDS=N (bench/recovery_stress.sh)")]


@pytest.mark.parametrize("round_", range(1, max(ROUNDS, 1) + 1))
def test_three_preemptions_complete_every_round(cluster, reference_weights, round_):
    run = f"stress-{round_}"
    final, names = preemption_chain(cluster, run, max_restarts=3, kills=3)
    assert final.state.is_completed(), final.state
    assert names == [run, f"{run}-attempt-2", f"{run}-attempt-3", f"{run}-attempt-4"], names
    weights = next((cluster["root"] / f"{run}-3").glob("runs/**/export/hf/model.safetensors"))
    assert weights.read_bytes() == reference_weights()
