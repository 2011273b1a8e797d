"""Tests of memfit.models.loading: tokenizer training, preset building/caching, loading errors, block lookup."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from memfit.config import MemfitConfig, ModelConfig
from memfit.data.formats import data_digest
from memfit.data.prepare import prepare_data
from memfit.data.synthetic import synthetic_corpus
from memfit.errors import ConfigError, ModelLoadError
from memfit.models.loading import (
    PRESET_MARKER,
    build_preset,
    check_seq_len,
    find_decoder_blocks,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    model_max_positions,
    preset_dir,
    train_tokenizer,
)

TEXTS = synthetic_corpus(60, seed=0)
TINY = {"vocab_size": 300, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 64}


def tiny_model_cfg(preset: str, **changes) -> ModelConfig:
    return ModelConfig(preset=preset, **(TINY | changes))


@pytest.fixture
def offline_hub(monkeypatch):
    """HF_HUB_OFFLINE=1 (env and the value huggingface_hub read at import) and sockets refused."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError(f"tried to open a network connection: {args[1:]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """Both presets built once for the module (3 layers for GPT-2 so the block count is not a default)."""
    root = tmp_path_factory.mktemp("presets")
    return {
        "tiny-llama": (build_preset(tiny_model_cfg("tiny-llama"), TEXTS, root / "llama", 1, 32), 2),
        "tiny-gpt2": (build_preset(tiny_model_cfg("tiny-gpt2", num_layers=3), TEXTS, root / "gpt2", 1, 96),
                      3),
    }


# --- tokenizer --------------------------------------------------------------------------------

@pytest.mark.unit
def test_tokenizer_round_trip_and_reload(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(TEXTS, vocab_size=300, out_dir=tmp_path / "tok")
    sentence = TEXTS[0]
    ids = tok(sentence, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == sentence
    assert len(ids) < len(sentence)  # merges were learned
    assert len(tok) == 300
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.unk_token is None
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert reloaded(sentence, add_special_tokens=False)["input_ids"] == ids
    assert reloaded.eos_token_id == tok.eos_token_id < len(reloaded)
    # Byte-level: text the training data never showed still round-trips without an unk token.
    odd = "Grüße, 東京! \t tabs"
    assert reloaded.decode(reloaded(odd, add_special_tokens=False)["input_ids"]) == odd


# --- presets ----------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_preset_reloads_and_runs(presets, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, n_layers = presets[preset]
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = model.config
    assert config.vocab_size == len(tok)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, attr) == tok.eos_token_id < config.vocab_size
    assert config.use_cache is True
    assert model_max_positions(config) == (64 if preset == "tiny-llama" else 96)  # max(cfg, max_seq_len)
    ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"][:10] for t in TEXTS[:2]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 10, config.vocab_size)
    assert torch.isfinite(logits).all()
    blocks = find_decoder_blocks(model)
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == n_layers
    assert json.loads((folder / PRESET_MARKER).read_text())["spec"]["preset"] == preset


@pytest.mark.integration
def test_preset_cache_hit_and_rebuild(tmp_path):
    cfg = tiny_model_cfg("tiny-llama")
    out = build_preset(cfg, TEXTS, tmp_path / "p", seed=1, max_seq_len=32)
    weights = out / "model.safetensors"
    mtime, marker = weights.stat().st_mtime_ns, (out / PRESET_MARKER).read_text()
    assert build_preset(cfg, TEXTS, tmp_path / "p", seed=1, max_seq_len=32) == out
    assert weights.stat().st_mtime_ns == mtime  # cache hit: nothing rewritten
    build_preset(cfg, TEXTS, tmp_path / "p", seed=2, max_seq_len=32)
    assert (out / PRESET_MARKER).read_text() != marker  # spec changed: rebuilt in place
    assert json.loads((out / PRESET_MARKER).read_text())["spec"]["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no build/old folders left behind


@pytest.mark.integration
def test_preset_weights_are_seeded_and_global_rng_untouched(tmp_path):
    from safetensors.torch import load_file

    cfg = tiny_model_cfg("tiny-gpt2", num_layers=1)
    state = torch.get_rng_state()
    a = build_preset(cfg, TEXTS, tmp_path / "a", seed=5, max_seq_len=32)
    b = build_preset(cfg, TEXTS, tmp_path / "b", seed=5, max_seq_len=32)
    c = build_preset(cfg, TEXTS, tmp_path / "c", seed=6, max_seq_len=32)
    assert torch.equal(torch.get_rng_state(), state)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


@pytest.mark.unit
def test_preset_dir_depends_on_spec(tmp_path):
    cfg = MemfitConfig.model_validate({"run": {"work_dir": str(tmp_path)}})
    d = preset_dir(cfg, "digest-a")
    assert d.parent == tmp_path / "presets" and d.name.startswith("tiny-llama-")
    assert preset_dir(cfg, "digest-a") == d
    assert preset_dir(cfg, "digest-b") != d
    cfg.train.seed += 1
    assert preset_dir(cfg, "digest-a") != d


@pytest.mark.integration
def test_load_model_and_tokenizer_preset_then_folder(tmp_path, offline_hub):
    cfg = MemfitConfig.model_validate({"run": {"work_dir": str(tmp_path)},
                                       "model": TINY | {"preset": "tiny-gpt2"},
                                       "data": {"seq_len": 16}})
    digest = data_digest(TEXTS)
    model, tok, source = load_model_and_tokenizer(cfg, TEXTS, digest)
    assert source == str(preset_dir(cfg, digest))
    assert model.dtype == torch.float32 and model.config.model_type == "gpt2"
    bundle = prepare_data(cfg, tok, TEXTS)
    assert bundle.train.shape[1] == 16 and int(bundle.train.max()) < len(tok)
    cfg.model.name_or_path = source  # the same folder, now as a user-given model
    model2, tok2, source2 = load_model_and_tokenizer(cfg, TEXTS, digest)
    assert source2 == source and len(tok2) == len(tok)
    check_seq_len(cfg, model2.config)


# --- loading errors ---------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("loader", [load_model, load_tokenizer])
def test_missing_local_folder(tmp_path, offline_hub, loader):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelLoadError, match=r"model\.name_or_path: folder .* not found"):
        loader(str(missing))
    with pytest.raises(ModelLoadError, match="not found"):
        loader("./definitely-missing-model-folder")


@pytest.mark.unit
def test_folder_without_config(tmp_path, offline_hub):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"model\.name_or_path: folder .* has no config\.json"):
        load_model(str(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize("loader", [load_model, load_tokenizer])
def test_unknown_hub_id_offline(offline_hub, loader):
    with pytest.raises(ModelLoadError) as info:
        loader("memfit-tests/no-such-model-xyz")
    msg = str(info.value)
    assert msg.startswith("model.name_or_path: could not load 'memfit-tests/no-such-model-xyz'")
    assert "hf download memfit-tests/no-such-model-xyz" in msg and "\n" not in msg


# --- sequence length and decoder blocks -------------------------------------------------------

@pytest.mark.unit
def test_check_seq_len():
    from transformers import GPT2Config, LlamaConfig

    cfg = MemfitConfig.model_validate({"data": {"seq_len": 256}})
    assert model_max_positions(LlamaConfig(max_position_embeddings=128)) == 128
    assert model_max_positions(GPT2Config(n_positions=200)) == 200
    assert model_max_positions(object()) is None
    check_seq_len(cfg, object())  # no limit known: accepted
    check_seq_len(cfg, LlamaConfig(max_position_embeddings=256))
    with pytest.raises(ConfigError, match=r"data\.seq_len \(256\) exceeds the model's maximum of 128 pos"):
        check_seq_len(cfg, LlamaConfig(max_position_embeddings=128))


@pytest.mark.unit
def test_find_decoder_blocks_generic_and_missing():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])  # mixed: not blocks
            self.stack = torch.nn.ModuleList([Block() for _ in range(3)])
            self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(2)])

    custom = Custom()
    assert find_decoder_blocks(custom) is custom.stack
    with pytest.raises(ModelLoadError, match="no decoder block list"):
        find_decoder_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
