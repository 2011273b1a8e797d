"""SafeTensors and ONNX export of tiny Llama and GPT-2 models built from configs (no downloads)."""

from __future__ import annotations

import json
import os
import re

import onnx
import pytest
import torch

from memfit import __version__
from memfit.errors import ExportError
from memfit.files import sha256_file
from memfit.release import formats as ex
from memfit.release.parity import ParityCriteria

pytestmark = [
    pytest.mark.integration,
    # Emitted inside torch.export's pytree code on every ONNX export; not ours to fix.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

SENTENCES = [
    "memfit fine-tunes language models on the GPU you have.",
    "The quick brown fox jumps over the lazy dog.",
    "Checkpoints survive spot preemption; exports are verified before they move.",
    "hello world 123",
]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _ids(tokenizer):
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


@pytest.fixture(scope="module")
def models(tokenizer):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    vocab = len(tokenizer)
    llama = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        **_ids(tokenizer))
    gpt2 = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64, **_ids(tokenizer))
    return {"llama": AutoModelForCausalLM.from_config(llama), "gpt2": AutoModelForCausalLM.from_config(gpt2)}


def _as_training(model):
    """Leave the model as a training loop would: train mode, checkpointing on, cache off."""
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    model.generation_config.use_cache = False
    assert model.is_activation_checkpointing


def _leftovers(folder):
    return [n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n or n.startswith(".memfit-write")]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_safetensors_export_reloads_with_same_logits(models, tokenizer, tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = models[arch]
    _as_training(model)
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")  # replaced as a whole, not merged

    res = ex.export_safetensors(model, tokenizer, out, metadata={"run": "r1", "step": 10})

    assert res.dir == str(out.absolute()) and res.max_abs_diff <= 1e-5
    assert sorted(os.listdir(tmp_path)) == ["export"] and not _leftovers(tmp_path)
    assert not (out / "stale.txt").exists()
    assert "model.safetensors" in res.files and not list(out.glob("*.bin"))
    # The source model was put in inference mode, and nothing of training leaks into the files.
    assert not model.training and not model.is_activation_checkpointing
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True and not config.get("gradient_checkpointing")
    assert json.loads((out / "generation_config.json").read_text())["use_cache"] is True

    manifest = json.loads((out / ex.MANIFEST_NAME).read_text())
    assert manifest["memfit_version"] == __version__
    assert manifest["metadata"] == {"run": "r1", "step": 10}
    assert manifest["files"] == res.files
    for name, info in res.files.items():
        assert (out / name).stat().st_size == info["bytes"]
        assert sha256_file(out / name) == info["sha256"]

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not reloaded.is_activation_checkpointing
    ids = torch.tensor([tokenizer("hello world, the quick fox")["input_ids"]] * 2)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - reloaded(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5
    tok2 = AutoTokenizer.from_pretrained(out)
    assert tok2(SENTENCES[0])["input_ids"] == tokenizer(SENTENCES[0])["input_ids"]


def test_safetensors_failed_verification_keeps_previous_export(models, tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained

    def perturbed(*args, **kwargs):  # a round trip is bit-exact, so corrupt the reloaded weights
        m = original(*args, **kwargs)
        with torch.no_grad():  # random, not constant: a constant shift vanishes after LayerNorm centring
            w = m.get_output_embeddings().weight
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
        return m

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", perturbed)
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    with pytest.raises(ExportError) as err:
        ex.export_safetensors(models["gpt2"], tokenizer, out)
    msg = str(err.value)
    assert str(out) in msg
    measured = float(re.search(r"max \|diff\| = ([0-9.e+-]+)", msg).group(1))
    assert measured > 1e-5
    assert os.listdir(out) == ["old.txt"] and sorted(os.listdir(tmp_path)) == ["export"]


@pytest.mark.parametrize(("arch", "opset"), [("gpt2", None), ("llama", 18)])
def test_onnx_parity_at_dynamic_shapes(models, tmp_path, monkeypatch, arch, opset):
    model = models[arch]
    _as_training(model)
    if arch == "llama":
        # Exercise the > 2 GB path on a tiny model: weights go to <name>.onnx.data beside the file.
        monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "onnx" / "model.onnx"

    res = ex.export_onnx(model, out, opset=opset)

    assert res.path == str(out.absolute()) and out.is_file()
    assert len(res.shapes) >= 3 and res.max_abs_diff <= 1e-4
    assert any(b != ex.EXAMPLE_SHAPE[0] and s != ex.EXAMPLE_SHAPE[1] for b, s in res.shapes)
    assert res.sha256 == sha256_file(out)
    assert res.external_data is (arch == "llama")
    assert (out.parent / "model.onnx.data").exists() is (arch == "llama")
    assert not _leftovers(out.parent)
    proto = onnx.load(str(out), load_external_data=False)
    assert res.opset == next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert res.opset == opset if opset else res.opset >= 18
    assert [i.name for i in proto.graph.input] == ["input_ids"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    # Callable on its own, at shapes the export never saw.
    assert [(p.batch, p.seq) for p in ex.verify_onnx(out, model, [(4, 3), (1, 30)])] == [(4, 3), (1, 30)]


def test_onnx_parity_failure_leaves_no_file(models, tmp_path):
    out = tmp_path / "model.onnx"
    with pytest.raises(ExportError) as err:
        ex.export_onnx(models["gpt2"], out, criteria=ParityCriteria(rtol=0.0, atol=1e-12))
    msg = str(err.value)
    assert str(out) in msg and ".tmp-" not in msg
    measured = float(re.search(r"= ([0-9.e+-]+) at shape \(batch=\d+, seq=\d+\)", msg).group(1))
    assert measured > 1e-12  # the real onnxruntime-vs-PyTorch difference, not a fake one
    assert os.listdir(tmp_path) == []


def test_onnx_shapes_must_prove_dynamic_axes(models, tmp_path):
    with pytest.raises(ExportError, match="dynamic"):
        ex.export_onnx(models["gpt2"], tmp_path / "m.onnx", shapes=((2, 16), (2, 5)))
    assert os.listdir(tmp_path) == []


def test_unwritable_output_folder(models, tokenizer, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ExportError, match="a-file") as err:
        ex.export_safetensors(models["gpt2"], tokenizer, blocker / "export")
    assert "writ" in str(err.value)
    with pytest.raises(ExportError, match="a-file"):
        ex.export_onnx(models["gpt2"], blocker / "model.onnx")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_output_folder(models, tokenizer, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ExportError, match="ro"):
            ex.export_safetensors(models["gpt2"], tokenizer, ro / "export")
    finally:
        ro.chmod(0o755)
