"""The rows a node's ranks train on are prepared once, before torchrun, also for a model not built on meta."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("meta_fails", [False, True])
def test_prepare_for_ranks_leaves_the_rows_cached(tmp_path, monkeypatch, meta_fails):
    import torch
    import transformers

    from memfit import config
    from memfit.data.cache import cached_data
    from memfit.data.source import DataSource
    from memfit.run_context import load_inputs, prepare_for_ranks

    cfg = config.load(None, [f"run.work_dir={tmp_path / 'work'}", "data.synthetic_docs=60", "data.seq_len=32",
                             "data.packing=auto"])
    if meta_fails:  # remote code that computes in __init__, say: the layout is still predicted, for sdpa
        real = transformers.AutoModelForCausalLM.from_config

        def refuse(*a, **k):
            if torch.get_default_device().type == "meta":
                raise RuntimeError("cannot build on meta")
            return real(*a, **k)  # the preset's own build

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    prepare_for_ranks(cfg)
    folders = [p for p in (tmp_path / "work" / "data-cache").iterdir() if (p / "meta.json").is_file()]
    assert len(folders) == 1
    # what a rank then does: the same rows, found cached, not prepared again
    monkeypatch.undo()
    inputs = load_inputs(cfg)
    monkeypatch.setattr("memfit.data.cache._prepare_into", lambda *a: pytest.fail("prepared again"))
    bundle = cached_data(cfg, DataSource(cfg.data, cfg.run.work_dir), inputs.digest, inputs.tokenizer,
                         inputs.model.config)
    assert bundle.train.shape[1] == 32
