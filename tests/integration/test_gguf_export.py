"""GGUF exports written by llama.cpp's converter and loaded by llama.cpp itself (llama-cpp-python): a tiny Llama run
gives f16 files whose greedy tokens equal transformers', q8_0 within its bound, the chat template intact, a Modelfile
beside them; the formats in MLflow, the registry and export.uri; `memfit export --format gguf`; tokenizers trained
here; a wrong conversion caught in one line. The families: test_gguf_families.py. Skipped where llama-cpp-python
(it builds llama.cpp from source: `pip install 'memfit[gguf]'`) or the converter is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests_support import cli_in_process, skip_without_gguf_tools, tiny_overrides

skip_without_gguf_tools()
pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["one two three", "the red fox", "3 plus 4 is"]


def _converter():
    from memfit.errors import ConfigError
    from memfit.release.gguf_converter import find

    try:
        return find()
    except ConfigError as err:
        pytest.skip(str(err))


def _greedy_hf(folder: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def _greedy_llama_cpp(path: Path, ids: list[int], n: int) -> list[int]:
    """llama.cpp's own sampler at top-k 1 (not memfit's verification loop): an independent oracle."""
    from memfit.release.llama_loader import open_gguf

    llm = open_gguf(str(path), n_ctx=128, verbose=False, seed=0, n_threads=1)
    try:
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0):
            if token == llm.token_eos() or len(out) == n:
                break
            out.append(int(token))
        return out
    finally:
        llm.close()


def _assert_greedy_equal(hf_dir: Path, gguf: Path, n: int = 8) -> None:
    for prompt in PROMPTS:
        ids, want = _greedy_hf(hf_dir, prompt, n)
        got = _greedy_llama_cpp(gguf, ids, n)
        assert got == want[: len(got)] and len(got) >= min(len(want), n) - 1, prompt


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """One tiny Llama run (configs/tiny.yaml, shortened) exporting SafeTensors + GGUF f16 and q8_0, with MLflow and
    the registry."""
    from memfit import config, phases

    _converter()
    root = tmp_path_factory.mktemp("gguf-llama")
    cfg = config.load(REPO / "configs" / "tiny.yaml", tiny_overrides(root, None, **{
        "train.max_steps": 12, "checkpoint.every_steps": 12, "train.warmup_steps": 2, "data.synthetic_docs": 400,
        "export.formats": "[safetensors,gguf]", "export.gguf_quants": "[f16,q8_0]", "train.num_threads": 1,
        "tracking.system_metrics": False, "export.uri": str(root / "exports")}))
    probe = phases.check_environment_and_probe(cfg)
    result = phases.train(cfg, phases.plan_stack(cfg, probe), phases.recover_training_checkpoint(cfg), probe)
    return cfg, phases.evaluate_and_release(cfg, result)


def test_a_q8_0_file_runs_on_this_cpu_with_amx_kernels_left_out_where_they_crash(llama_run, monkeypatch):
    """llama.cpp's AMX kernels segfault on the first q8_0 decode (ggml-org/llama.cpp#20824; every q8_0 file on this
    project's Sapphire-Rapids-class CI machine, taking the pytest worker with it): memfit opens GGUF files with
    llama.cpp's extra buffer types off where its CPU backend reports AMX-INT8, and as the variable says otherwise."""
    import llama_cpp

    from memfit.release.llama_loader import ENV, open_gguf

    path = Path(llama_run[1].gguf["dir"]) / "model-q8_0.gguf"
    amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()
    llm = open_gguf(path, n_ctx=64, verbose=False, seed=0, n_threads=1)
    try:
        assert llm.model_params.use_extra_bufts is not amx
        llm.eval(llm.tokenize(b"one two three", add_bos=True, special=True))  # the decode that crashed
        assert len(llm.scores[llm.n_tokens - 1]) == llm.n_vocab()
    finally:
        llm.close()
    monkeypatch.setenv(ENV, "0")  # off everywhere: the same file still runs
    llm = open_gguf(path, n_ctx=64, verbose=False, vocab_only=True)
    assert llm.model_params.use_extra_bufts is False
    llm.close()
    # the module's default parameters are left as they were (only the load saw them changed)
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_a_llama_run_exports_gguf_that_llama_cpp_runs_like_transformers(llama_run, tmp_path):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from mlflow import MlflowClient
    from transformers import AutoTokenizer

    from memfit.files import sha256_file
    from memfit.release.llama_loader import open_gguf
    from memfit.release.modelfile import parse_modelfile

    cfg, exported = llama_run
    assert exported.onnx_path is None  # export.formats replaced the default list
    folder = Path(exported.gguf["dir"])
    assert folder == Path(cfg.export.dir).absolute() / "gguf"
    manifest = json.loads((folder / "memfit-gguf.json").read_text())
    assert set(manifest["files"]) == {"model-f16.gguf", "model-q8_0.gguf", "Modelfile"}
    assert manifest["converter"] == _converter().record()  # llama.cpp's commit and the sdist it came from
    assert all(sha256_file(folder / n) == rec["sha256"] for n, rec in manifest["files"].items())
    figures = {f["quant"]: f for f in exported.gguf["files"]}
    assert figures["f16"]["greedy_equal"] == figures["f16"]["prompts"] == len(cfg.eval.prompts)
    assert figures["q8_0"]["top1_agree"] >= cfg.export.gguf_min_top1.q8_0
    assert figures["q8_0"]["bytes"] < 0.7 * figures["f16"]["bytes"]

    _assert_greedy_equal(Path(exported.safetensors_dir), folder / "model-f16.gguf")

    # The chat template travels in the GGUF and renders like the tokenizer's (without transformers' generation tags).
    tok = AutoTokenizer.from_pretrained(exported.safetensors_dir)
    llm = open_gguf(str(folder / "model-q8_0.gguf"), n_ctx=64, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    llm.close()
    chat = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"},
            {"role": "user", "content": "the red"}]
    rendered = Jinja2ChatFormatter(template, tok.eos_token, tok.bos_token, add_generation_prompt=True)(messages=chat)
    assert rendered.prompt == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    modelfile = parse_modelfile((folder / "Modelfile").read_text())
    assert modelfile[0] == ("FROM", "./model-q8_0.gguf") and ("PARAMETER", f'stop "{tok.eos_token}"') in modelfile
    assert any(word == "TEMPLATE" for word, _ in modelfile)

    client = MlflowClient(cfg.tracking.resolved_uri())
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.data.metrics["gguf_f16_top1_agree"] == figures["f16"]["top1_agree"]
    assert run.data.tags["memfit.formats"] == "safetensors,gguf"
    assert "q8_0: greedy" in run.data.tags["memfit.format.gguf"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "export/gguf")}
    assert {"export/gguf/model-q8_0.gguf", "export/gguf/Modelfile"} <= logged
    version = client.get_model_version(exported.registry["model_name"], exported.registry["version"])
    assert version.tags["memfit.format.gguf"] == run.data.tags["memfit.format.gguf"]

    # export.uri holds the GGUF folder beside hf/ (files, Modelfile, memfit-gguf.json), listed before the manifest.
    from memfit.release.uploads import download_export, read_manifest

    uploaded = read_manifest(exported.export_uri)
    assert exported.export_uri.endswith(f"/exports/{run.info.run_id}") and uploaded["formats"]["gguf"]["quants"] == [
        "f16", "q8_0"]
    keys = {f"gguf/{n}" for n in [*manifest["files"], "memfit-gguf.json"]}
    assert {k for k, rec in uploaded["files"].items() if rec["format"] == "gguf"} == keys
    fetched = download_export(exported.export_uri, tmp_path / "fetched", formats=["gguf"])
    assert all(sha256_file(fetched / k) == sha256_file(folder.parent / k) for k in keys)


def test_memfit_export_writes_one_quant_from_a_training_checkpoint(llama_run, tmp_path):
    cfg, _ = llama_run
    out = tmp_path / "out"
    result = cli_in_process("export", cfg.checkpoint.uri, "--out", out, "--format", "gguf", "--quant", "q8_0")
    assert result.exit_code == 0, result.output
    assert "GGUF q8_0:" in result.output and "Modelfile:" in result.output
    assert sorted(p.name for p in (out / "gguf").iterdir()) == ["Modelfile", "memfit-gguf.json", "model-q8_0.gguf"]
    assert not (out / "model.onnx").exists() and (out / "hf" / "config.json").is_file()
    bad = cli_in_process("export", cfg.checkpoint.uri, "--out", out, "--format", "ggml")
    assert bad.exit_code == 2 and "--format ggml: not a format" in bad.output
    bad = cli_in_process("export", cfg.checkpoint.uri, "--out", out, "--format", "gguf", "--quant", "iq2_xs")
    assert bad.exit_code == 2 and "iq2_xs not available" in bad.output


def test_a_wrong_conversion_is_caught_by_llama_cpp_in_one_line(tmp_path):
    """A converter checkout (export.gguf_converter) whose Llama q/k row permutation is gone (rope pairs mixed up):
    its file runs, but is not the trained model."""
    import shutil

    from family_support import family_folder

    from memfit.errors import ExportError
    from memfit.release.gguf_export import export_gguf

    broken = tmp_path / "llama.cpp"
    shutil.copytree(_converter().dir, broken)
    source = (broken / "conversion" / "llama.py").read_text()
    (broken / "conversion" / "llama.py").write_text(source.replace(".swapaxes(1, 2)", "", 1))
    folder = family_folder(tmp_path, "llama")
    with pytest.raises(ExportError, match="greedy tokens differ|top-1 agreement") as err:
        export_gguf(folder, tmp_path / "gguf", ["f16"], prompts=PROMPTS, min_top1={"f16": 0.98}, converter=broken)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "gguf").exists()  # nothing half-written


def test_serve_model_serves_the_gguf_through_llama_cpp_like_transformers(llama_run):
    """serve.backend=llama.cpp answers greedy completions as the transformers backend does (f16), also when two
    requests share a batch (their llama.cpp states take turns); an export without the quant is one line."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from memfit.errors import ModelLoadError
    from memfit.server.run import start_in_thread

    cfg, exported = llama_run
    folder = str(Path(cfg.export.dir))

    def answers(backend: str, quant: str = "f16", model: str = folder) -> list[str]:
        served = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={
            "backend": backend, "gguf_quant": quant, "follow_alias": False, "batch_wait_ms": 200.0,
            "cache_dir": str(Path(cfg.run.work_dir) / "serve")})})
        running = start_in_thread(served, model, port=0)
        try:
            def ask(prompt: str) -> str:
                r = httpx.post(f"{running.url}/v1/completions", timeout=60,
                               json={"model": running.state.holder.current.files.name, "prompt": prompt,
                                     "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(ask, PROMPTS[:2])) + [ask(PROMPTS[2])]
        finally:
            running.stop()

    want = answers("transformers")
    assert answers("llama.cpp") == want and any(want)
    assert exported.registry["version"]  # the registry version's export/gguf artifact, served
    assert answers("llama.cpp", model=f"models:/{exported.registry['model_name']}@champion") == want
    with pytest.raises(ModelLoadError, match="no model-q4_k_m.gguf"):
        answers("llama.cpp", "q4_k_m")


def test_llama_cpp_streams_logprobs_that_join_to_the_answer_without_stream(llama_run):
    """The llama.cpp backend scores a stream's chunks between its generation steps, in its one context (alone, or two
    streams taking turns in a batch): the chunks joined are the answer without stream, its text unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from memfit.server.run import start_in_thread

    cfg, _ = llama_run
    served = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={
        "backend": "llama.cpp", "gguf_quant": "f16", "follow_alias": False, "batch_wait_ms": 200.0})})
    running = start_in_thread(served, str(Path(cfg.export.dir)), port=0)
    try:
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = running.state.holder.current.files.name

        def both(prompt: str) -> tuple:
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
            chunks = [c.choices[0] for c in api.completions.create(**body, stream=True)]
            return api.completions.create(**body).choices[0], chunks

        with ThreadPoolExecutor(2) as pool:  # the two streams share a batch
            answers = list(pool.map(both, PROMPTS[:2])) + [both(PROMPTS[2])]
        for whole, chunks in answers:
            parts = [c.logprobs for c in chunks]
            assert "".join(c.text for c in chunks) == whole.text
            assert [t for lp in parts for t in lp.tokens] == whole.logprobs.tokens
            assert [x for lp in parts for x in lp.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs,
                                                                                   abs=1e-5)  # measured: equal
        chat = {"model": model, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 6,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
        whole = api.chat.completions.create(**chat).choices[0]
        chunks = [c.choices[0] for c in api.chat.completions.create(**chat, stream=True)]
        got = [e for c in chunks for e in c.logprobs.content]
        assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
        assert [e.token for e in got] == [e.token for e in whole.logprobs.content]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-5)
    finally:
        running.stop()


def test_gguf_stops_before_training_without_the_converter_or_its_architecture(tiny_config, tmp_path):
    from memfit.errors import ConfigError
    from memfit.preflight import preflight

    _converter()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "fancy", "architectures": ["FancyLM"]}))
    gguf = {"export.formats": "[safetensors,gguf]", "model.preset": "null", "model.name_or_path": str(tmp_path / "m")}
    with pytest.raises(ConfigError, match="converter .* does not know the architecture FancyLM") as err:
        preflight(tiny_config(**gguf))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=f"not installed at {tmp_path / 'none'}: run `memfit gguf-converter install`"):
        preflight(tiny_config(**{**gguf, "export.gguf_converter": str(tmp_path / "none")}))


def _sentencepiece_style_llama(folder: Path) -> Path:
    """A Llama with a tokenizer like Llama 2's / Mistral's tokenizer.json: BPE on ▁-joined text with byte fallback,
    <s> prepended; trained here (no tokenizer.model, so no SentencePiece scores)."""
    from chat_support import conversation_texts
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from memfit.data.templates import PRESET_CHAT_TEMPLATE

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(conversation_texts(), trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                      show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.chat_template = PRESET_CHAT_TEMPLATE
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def test_a_sentencepiece_style_tokenizer_tokenizes_alike_in_llama_cpp(tmp_path):
    """llama.cpp's SPM tokenizer merges by score; the scores memfit's runner derives from the merge order (the
    converter's own: -1000 for every token) give the same ids."""
    from memfit.release.gguf_export import export_gguf

    folder = _sentencepiece_style_llama(tmp_path / "spm")
    res = export_gguf(folder, tmp_path / "gguf", ["f16"], prompts=PROMPTS, min_top1={"f16": 0.98})
    assert res.files[0].greedy_equal == len(PROMPTS) and res.chat_template_equal


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_pre_tokenizers_split_text_as_llama_cpp_does(tmp_path, pre):
    """Byte-level BPE behind Llama 3's / Qwen2's split regex (digits, punctuation, newlines), trained here: llama.cpp
    knows the regex by name (memfit reads it from tokenizer.json) and gives the same ids; no <bos> added by either."""
    from chat_support import conversation_texts
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from memfit.release.gguf import PRE_BY_REGEX
    from memfit.release.gguf_export import export_gguf

    regex = next(r for r, name in PRE_BY_REGEX.items() if name == pre)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(conversation_texts() + ["12345 678, it's 3.14!\n\n  x"], trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")
    prompts = ["one two three", "12345 678, it's 3.14!", "the red fox\n\n  jumps"]
    res = export_gguf(tmp_path / "m", tmp_path / "gguf", ["f16"], prompts=prompts, min_top1={"f16": 0.98})
    assert res.files[0].greedy_equal == len(prompts)
