"""torch's CPU threads: the config's number, else OMP_NUM_THREADS (torchrun, a scheduler, a test runner), else cores."""

from __future__ import annotations

import os

import pytest
import torch

from memfit.runtime.env import default_threads, pin_threads

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_omp_num_threads_is_the_default_when_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    assert pin_threads(None) == 1 and torch.get_num_threads() == 1


def test_the_config_wins_over_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert pin_threads(2) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["", "0", "two", "-3"])
def test_without_a_usable_omp_num_threads_the_cores_at_most_four(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_threads() == max(1, min(4, os.cpu_count() or 1))


def test_ranks_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert default_threads(2) == max(1, min(4, cores // 2))
    assert default_threads(cores * 2) == 1  # never zero threads
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads(2) == 3
