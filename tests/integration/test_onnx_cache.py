"""The ONNX graph cache: a repeat export of an architecture reuses its graph with the new weights, always verified."""

from __future__ import annotations

import json
import logging
import shutil

import onnx
import onnxruntime as ort
import pytest
import torch

from memfit.files import CACHE_ENV
from memfit.models.loading import preset_config
from memfit.release import formats as ex
from memfit.release import onnx_cache
from memfit.release.parity import ParityCriteria, parity_failure, shape_parity

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

SHAPE = (3, 7)  # a shape the export verification does not use


def _model(preset: str, seed: int, layers: int = 2, vocab: int = 96):
    """A preset-shaped model (tiny-llama / tiny-gpt2 of memfit/models/loading.py) with seeded random weights."""
    from transformers import AutoModelForCausalLM

    spec = {"preset": preset, "hidden_size": 32, "num_layers": layers, "num_heads": 4, "max_positions": 64}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(preset_config(spec, vocab, 0)).eval()
        # Random init leaves every norm weight at 1; move them so they are weights like any other.
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
    return model


def _onnx_logits(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids.numpy()})[0]


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float().numpy()


def _matches(model, path) -> bool:
    """Whether the ONNX file's logits meet the export's own parity criteria against `model`."""
    ids = ex.sample_ids(model.config.vocab_size, *SHAPE, seed=5)
    figures = [shape_parity(_torch_logits(model, ids), _onnx_logits(path, ids))]
    return parity_failure(str(path), figures, ParityCriteria()) is None


def _entries(folder):
    return sorted((folder / onnx_cache.SUBDIR).glob("*.onnx"))


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory):
    """A cache folder holding the entry of one full export of a tiny Llama (seed 0), and that export."""
    folder = tmp_path_factory.mktemp("onnx-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(folder))
        res = ex.export_onnx(_model("tiny-llama", 0), folder / "first.onnx")
    assert res.graph_source == "export" and len(_entries(folder)) == 1
    return folder, res


@pytest.fixture
def cache(llama_cache, tmp_path, monkeypatch):
    """A private copy of `llama_cache`'s folder as MEMFIT_CACHE_DIR, so tests can damage it."""
    folder = tmp_path / "cache"
    shutil.copytree(llama_cache[0] / onnx_cache.SUBDIR, folder / onnx_cache.SUBDIR)
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def _graph(path):
    """Nodes (without their generated names) and initializers of an ONNX file."""
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        node.name = ""
    return [n.SerializeToString() for n in proto.graph.node], [t.SerializeToString() for t in proto.graph.initializer]


def test_same_architecture_new_weights_takes_cached_graph(cache, llama_cache, tmp_path):
    first, second = _model("tiny-llama", 0), _model("tiny-llama", 1)
    out = tmp_path / "model.onnx"

    res = ex.export_onnx(second, out)

    assert res.graph_source == "cache"
    assert json.loads((tmp_path / "model.onnx.memfit.json").read_text())["graph_source"] == "cache"
    assert len(res.per_shape) == len(ex.DEFAULT_SHAPES)  # verified like a fresh export
    assert _matches(second, out) and not _matches(first, out)
    # The same weights through the cache give the graph a full export gave (only generated node names may differ).
    again = ex.export_onnx(first, tmp_path / "again.onnx")
    assert again.graph_source == "cache"
    assert _graph(tmp_path / "again.onnx") == _graph(llama_cache[1].path)


def test_cached_graph_with_external_data(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    model = _model("tiny-llama", 2)
    res = ex.export_onnx(model, tmp_path / "model.onnx")
    assert res.graph_source == "cache" and res.external_data and (tmp_path / "model.onnx.data").is_file()
    assert _matches(model, tmp_path / "model.onnx")


def test_key_changes_with_architecture_not_weights():
    def key(model):
        return onnx_cache.graph_key(ex.LogitsOnly(model), model, ex.EXAMPLE_SHAPE, None)

    base = key(_model("tiny-llama", 0))
    assert key(_model("tiny-llama", 1)) == base
    assert key(_model("tiny-llama", 0, layers=3)) != base
    assert key(_model("tiny-llama", 0, vocab=128)) != base
    tied, untied = _model("tiny-gpt2", 0), _model("tiny-gpt2", 0)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert key(tied) != base and key(untied) != key(tied)  # same config, another tensor layout
    assert onnx_cache.graph_key(ex.LogitsOnly(_model("tiny-llama", 0)), _model("tiny-llama", 0),
                                ex.EXAMPLE_SHAPE, 18) != base


def test_gpt2_tied_weights_miss_then_hit(cache, tmp_path):
    first, second = _model("tiny-gpt2", 0), _model("tiny-gpt2", 1)
    assert second.lm_head.weight is second.get_input_embeddings().weight

    res1 = ex.export_onnx(first, tmp_path / "a.onnx")
    res2 = ex.export_onnx(second, tmp_path / "b.onnx")

    assert res1.graph_source == "export"  # another architecture than the cached Llama
    assert len(_entries(cache)) == 2
    assert res2.graph_source == "cache"
    assert _matches(second, tmp_path / "b.onnx") and not _matches(first, tmp_path / "b.onnx")


def test_corrupt_entry_warns_and_exports_in_full(cache, tmp_path, caplog):
    (entry,) = _entries(cache)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 3])
    model = _model("tiny-llama", 3)

    with caplog.at_level(logging.WARNING, logger="memfit.release"):
        res = ex.export_onnx(model, tmp_path / "model.onnx")

    assert res.graph_source == "export" and _matches(model, tmp_path / "model.onnx")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "memfit.release"]
    assert len(warnings) == 1 and "unreadable" in warnings[0] and str(entry) in warnings[0]
    # The full export rewrote the entry: the next export of the architecture hits it.
    assert ex.export_onnx(_model("tiny-llama", 4), tmp_path / "next.onnx").graph_source == "cache"


def test_entry_that_computes_something_else_falls_back(cache, tmp_path, caplog):
    (entry,) = _entries(cache)
    proto = onnx.load(str(entry))
    # A readable entry whose graph is wrong: every residual Add becomes a Sub.
    adds = [n for n in proto.graph.node if n.op_type == "Add"]
    assert adds
    for node in adds:
        node.op_type = "Sub"
    entry.write_bytes(proto.SerializeToString())
    model = _model("tiny-llama", 5)

    with caplog.at_level(logging.WARNING, logger="memfit.release"):
        res = ex.export_onnx(model, tmp_path / "model.onnx")

    assert res.graph_source == "export" and _matches(model, tmp_path / "model.onnx")
    assert any("failed its checks" in r.getMessage() for r in caplog.records)


def test_entry_with_wrong_weight_shape_falls_back(cache, tmp_path, caplog):
    (entry,) = _entries(cache)
    proto = onnx.load(str(entry))
    prop = next(p for p in proto.metadata_props if p.key == "memfit.weights")
    weights = json.loads(prop.value)
    name = next(n for n in weights if n.endswith("lm_head.weight"))
    weights[name][0] = [weights[name][0][0] + 1, weights[name][0][1]]
    prop.value = json.dumps(weights)
    entry.write_bytes(proto.SerializeToString())
    model = _model("tiny-llama", 6)

    with caplog.at_level(logging.WARNING, logger="memfit.release"):
        res = ex.export_onnx(model, tmp_path / "model.onnx")

    assert res.graph_source == "export" and _matches(model, tmp_path / "model.onnx")
    assert any("does not fit" in r.getMessage() and name in r.getMessage() for r in caplog.records)


def test_cached_graph_the_optimizer_rejects_falls_back(cache, tmp_path, monkeypatch, caplog):
    loaded = onnx_cache.load

    def load_then_break(key, wrapper):
        program = loaded(key, wrapper)
        # An entry that parses and maps but breaks the optimizer: drop the node producing the logits.
        graph = program.model.graph
        graph.remove(graph.outputs[0].producer(), safe=False)
        return program

    monkeypatch.setattr(onnx_cache, "load", load_then_break)
    model = _model("tiny-llama", 7)

    with caplog.at_level(logging.WARNING, logger="memfit.release"):
        res = ex.export_onnx(model, tmp_path / "model.onnx")

    assert res.graph_source == "export" and _matches(model, tmp_path / "model.onnx")
    assert any(r.name == "memfit.release" and "full export" in r.getMessage() for r in caplog.records)
