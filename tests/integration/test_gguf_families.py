"""The GGUF family matrix: a tiny random-weight model of each family users bring, written by llama.cpp's own
converter through memfit's export, run by llama.cpp: f16 greedy tokens equal to transformers', q8_0 top-1 agreement
within its bound. Skipped without llama-cpp-python or the converter (`memfit gguf-converter install`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_support import GGUF_FAMILIES, family_folder
from tests_support import skip_without_gguf_tools

skip_without_gguf_tools()
pytestmark = pytest.mark.integration
# Two prompts, 6 new tokens: 24 positions compared per file; digits, which Qwen2's tokenizer splits singly.
PROMPTS = ["one two three", "3 plus 4 is"]
BOUNDS = {"f16": 0.98, "q8_0": 0.9}  # export.gguf_min_top1's defaults


def _converter():
    from memfit.errors import ConfigError
    from memfit.release.gguf_converter import find

    try:
        return find()
    except ConfigError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family → (its folder, export_gguf's result or the exception it raised): each family built and exported once
    for every test of this module."""
    from memfit.release.gguf_export import export_gguf

    _converter()
    root, done = tmp_path_factory.mktemp("gguf-families"), {}

    def get(name: str):
        if name not in done:
            model_type, config = GGUF_FAMILIES[name]
            folder = family_folder(root / name, model_type, **config)
            try:
                done[name] = folder, export_gguf(folder, root / name / "gguf", ["f16", "q8_0"], prompts=PROMPTS,
                                                 min_top1=BOUNDS, max_new_tokens=6)
            except Exception as err:  # noqa: BLE001 - the test names it
                done[name] = folder, err
        return done[name]

    return get


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_each_family_runs_in_llama_cpp_like_transformers(exported, name):
    folder, res = exported(name)
    assert not isinstance(res, Exception), f"{name}: {res}"
    f16, q8 = res.files
    assert (f16.quant, q8.quant) == ("f16", "q8_0")
    assert f16.greedy_equal == f16.prompts == len(PROMPTS) and f16.top1_agree >= BOUNDS["f16"]
    # f16 rounding alone: measured 4e-9 to 5e-8 for every family; a wrong rope base in one layer of Gemma 3 gave 3e-4.
    assert f16.max_kl < 1e-6
    assert q8.top1_agree >= BOUNDS["q8_0"] and q8.bytes < f16.bytes
    manifest = (Path(res.dir) / "memfit-gguf.json").read_text()
    assert "convert_hf_to_gguf.py" in manifest and "llama_cpp_commit" in manifest


def test_the_families_come_out_as_llama_cpp_names_them(exported):
    """llama.cpp's own family (general.architecture), not one memfit chose: the converter picked it."""
    want = {"llama3": "llama", "mistral": "llama", "qwen3_moe": "qwen3moe", "gemma3": "gemma3", "olmo2": "olmo2",
            "gpt2": "gpt2", "phi3": "phi3", "mixtral": "llama"}
    got = {name: exported(name)[1] for name in want}
    assert {n: getattr(r, "architecture", r) for n, r in got.items()} == want


@pytest.mark.parametrize(("model_type", "config", "why"), [
    ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 32}, "query_pre_attn_scalar 32"),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16},
     "norm_topk_prob false"),
])
def test_configs_llama_cpp_would_compute_otherwise_are_refused_in_one_line(tmp_path, model_type, config, why):
    """Both convert and load, but llama.cpp computes them otherwise (measured: greedy tokens differ); refused before
    any work, as preflight refuses them before training."""
    from memfit.errors import ConfigError
    from memfit.release.gguf_export import export_gguf

    _converter()
    folder = family_folder(tmp_path, model_type, **config)
    with pytest.raises(ConfigError, match=why) as err:
        export_gguf(folder, tmp_path / "gguf", ["f16"], prompts=PROMPTS, min_top1=BOUNDS)
    assert "\n" not in str(err.value) and not (tmp_path / "gguf").exists()
