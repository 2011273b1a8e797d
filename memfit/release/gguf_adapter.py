"""A LoRA adapter as GGUF (llama.cpp's convert_lora_to_gguf.py) on its base's GGUF, checked against the merged model."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import memfit
from memfit.errors import ConfigError, ExportError
from memfit.files import commit_folder, file_record, sha256_file, staged_folder

ADAPTER_GGUF_DIR = "gguf-adapter"
MANIFEST_NAME = "memfit-gguf-adapter.json"  # written last: a folder without it is not a finished export
ADAPTER_FILE = "adapter-f16.gguf"
# llama.cpp's general.file_type (enum llama_ftype) → the quant whose bound applies to a base GGUF a user brings.
FILE_TYPES = {0: "f16", 1: "f16", 7: "q8_0", 15: "q4_k_m"}
log = logging.getLogger("memfit.release")


@dataclass(frozen=True)
class PeftSource:
    """What phase 5 hands over: the run's peft folder, the base it trained on (folder or hub id), its quantization."""

    dir: str
    base: str
    quantization: str


@dataclass
class GgufAdapterExport:
    """A written and verified gguf-adapter folder: the adapter, the base it was checked on, and the figures."""

    dir: str
    adapter: str
    adapter_bytes: int
    base_model: str  # the base the run trained on (folder or hub id)
    base_gguf: str | None  # export.gguf_adapter_base: the user's own base GGUF (not copied), else None
    files: list[Any] = field(default_factory=list)  # QuantFigures: base GGUF + adapter against the merged model
    without_adapter: Any = None  # QuantFigures: the served base alone, the adapter's visible effect
    chat_template_equal: bool | None = None
    modelfile: str = ""
    converter: dict[str, str] = field(default_factory=dict)
    convert_seconds: float = 0.0
    verify_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        out = {"gguf_adapter_bytes": float(self.adapter_bytes), "gguf_adapter_convert_seconds": self.convert_seconds,
               "gguf_adapter_verify_seconds": self.verify_seconds,
               "gguf_adapter_base_only_top1_agree": self.without_adapter.top1_agree}
        for f in self.files:
            out.update({f"gguf_adapter_{f.quant}_top1_agree": f.top1_agree, f"gguf_adapter_{f.quant}_max_kl": f.max_kl,
                        f"gguf_adapter_{f.quant}_greedy_equal": f.greedy_equal / f.prompts})
        return out

    def summary(self) -> str:
        """One line for the run's tag and the CLI: each base with the adapter, then the base alone."""
        w = self.without_adapter
        return "; ".join(f"{f.quant} base + adapter: greedy {f.greedy_equal}/{f.prompts}, top-1 {f.top1_agree:.1%}, "
                         f"max KL {f.max_kl:.2g}" for f in self.files) + (
            f"; base alone: greedy {w.greedy_equal}/{w.prompts}, top-1 {w.top1_agree:.1%}")


def check_gguf_adapter_export(export: Any, lora: Any, converter: str | None) -> None:
    """Before training, in one line: a run that has no adapter, a QLoRA base llama.cpp would not reproduce, a missing
    base GGUF, converter or llama-cpp-python."""
    import importlib.util

    if lora.enabled is False:
        raise ConfigError("export.formats gguf-adapter: this run trains all weights (lora.enabled is false), so "
                          "there is no adapter; set lora.enabled=true (or auto), or export the model with gguf")
    if lora.quantize != "none":
        raise ConfigError(f"export.formats gguf-adapter: a QLoRA adapter (lora.quantize={lora.quantize}) is trained "
                          "on the 4-bit base, and llama.cpp would apply it to a 16-bit one; export the merged model "
                          "with gguf instead")
    if export.gguf_adapter_base and not Path(export.gguf_adapter_base).expanduser().is_file():
        raise ConfigError(f"export.gguf_adapter_base: {export.gguf_adapter_base} is not a file (a GGUF of the "
                          "base model the run trains)")
    if importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError("export.formats gguf-adapter: llama-cpp-python verifies the adapter and is not "
                          "installed; `pip install 'memfit[gguf]'`")
    from memfit.release.gguf_converter import find

    find(converter)


def base_folder(source: str, cache_dir: str | None = None) -> Path:
    """The base's local folder: itself, or for a hub id the snapshot from_pretrained used (never a download;
    `cache_dir`: the hub cache, default HF_HUB_CACHE)."""
    if Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True, cache_dir=cache_dir))
    except Exception as err:  # noqa: BLE001 - not cached (or an odd id): say what to do in one line
        raise ExportError(f"gguf-adapter: base {source} is not in the local Hugging Face cache "
                          f"({type(err).__name__}); point model.name_or_path at its folder") from None


def _base_with_tokenizer(base: Path, tokenizer: Any, into: Path) -> Path:
    """The base's config and weights (linked) with the run's tokenizer and chat template: the base GGUF then
    tokenizes and templates as the run did. The tokenizer is written first, so no link is ever written through;
    the base's files it did not write (e.g. a sentencepiece tokenizer.model) are linked too."""
    tokenizer.save_pretrained(str(into))
    for p in base.iterdir():
        if p.is_file() and not (into / p.name).exists():
            (into / p.name).symlink_to(p.resolve())
    return into


def _quant_of(path: Path) -> str:
    """The quant of a GGUF file, as its header says (general.file_type), read by llama.cpp without the weights."""
    from memfit.release.llama_loader import open_gguf

    llm = open_gguf(str(path), vocab_only=True, verbose=False)
    try:
        file_type = llm.metadata.get("general.file_type")
    finally:
        llm.close()
    return FILE_TYPES.get(int(file_type) if file_type is not None else 1, "q4_k_m")  # unknown: the loosest bound


def export_gguf_adapter(peft: PeftSource, merged_dir: str | Path, final: str | Path, quants: list[str], *,
                        prompts: list[str], min_top1: dict[str, float], max_new_tokens: int = 16,
                        base_gguf: str | None = None, converter: str | None = None) -> GgufAdapterExport:
    """peft.dir → final/adapter-f16.gguf (llama.cpp's convert_lora_to_gguf.py), beside the base as GGUF (its
    converter, then its quantizer; or the user's `base_gguf`), each base loaded by llama-cpp-python with the adapter
    and compared with transformers' merged model (merged_dir); staged, memfit-gguf-adapter.json last, renamed."""
    from transformers import AutoTokenizer

    from memfit.release.gguf import pre_tokenizer, quantize, tokenizer_doc
    from memfit.release.gguf_converter import find, run
    from memfit.release.gguf_export import _reference, judge, verify_file
    from memfit.release.modelfile import MODELFILE_NAME, check_paths, modelfile_text, parse_modelfile, with_adapter

    if peft.quantization != "none":
        raise ExportError(f"gguf-adapter: the adapter was trained on a {peft.quantization} base, which llama.cpp "
                          "does not reproduce; export the merged model with gguf instead")
    conv, merged_dir, final = find(converter), Path(merged_dir), Path(final).absolute()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with staged_folder(final) as staged, tempfile.TemporaryDirectory(prefix="memfit-gguf-base-") as tmp:
        base = _base_with_tokenizer(base_folder(peft.base), tokenizer, Path(tmp))
        adapter = staged / ADAPTER_FILE
        run(conv, "convert_lora_to_gguf.py", [peft.dir, "--base", str(base), "--outtype", "f16", "--outfile",
                                              str(adapter)])
        if base_gguf:
            bases = [(Path(base_gguf).expanduser().absolute(), _quant_of(Path(base_gguf).expanduser()))]
        else:
            f16 = staged / "base-f16.gguf"
            run(conv, "convert_hf_to_gguf.py", [str(base), "--outtype", "f16", "--outfile", str(f16)],
                pre_tokenizer=pre_tokenizer(tokenizer_doc(base)))
            bases = [(staged / f"base-{q}.gguf", q) for q in quants]
            for path, quant in bases:
                if quant != "f16":
                    quantize(f16, path, quant)
        converted = time.monotonic()
        result = GgufAdapterExport(dir=str(final), adapter=str(final / ADAPTER_FILE),
                                   adapter_bytes=adapter.stat().st_size, base_model=peft.base,
                                   base_gguf=str(bases[0][0]) if base_gguf else None,
                                   converter=_record(conv, not base_gguf),
                                   convert_seconds=round(converted - started, 2))
        ref = _reference(merged_dir, tokenizer, prompts, max_new_tokens)
        for path, quant in bases:
            figures, result.chat_template_equal = verify_file(path, quant, tokenizer, ref, lora=adapter)
            judge(figures, min_top1, tokenizer.chat_template if not base_gguf else None,
                  result.chat_template_equal, what=f"gguf-adapter: {ADAPTER_FILE} on {path.name}",
                  reference="the merged model", meaning="base + adapter do not compute the trained model")
            result.files.append(figures)
        served = next(((p, q) for p, q in bases if q != "f16"), bases[0])
        result.without_adapter = verify_file(served[0], served[1], tokenizer, ref)[0]
        result.verify_seconds = round(time.monotonic() - converted, 2)
        if not base_gguf and "f16" not in quants:
            (staged / "base-f16.gguf").unlink()
        positions = min(int(json.loads((base / "config.json").read_text()).get("max_position_embeddings") or 4096),
                        4096)
        text = with_adapter(modelfile_text(served[0].name, tokenizer, positions)[0],
                            str(served[0]) if base_gguf else served[0].name, ADAPTER_FILE)
        (staged / MODELFILE_NAME).write_text(text)
        check_paths(parse_modelfile(text), staged)  # what `ollama create` will look for is there
        result.modelfile = str(final / MODELFILE_NAME)
        for f in [*result.files, result.without_adapter]:  # where they will be once renamed into place
            f.file = str(f.file if base_gguf else final / Path(f.file).name)
        manifest = {"memfit_version": memfit.__version__, "format": "gguf-adapter", "base_model": peft.base,
                    "base_gguf": ({"path": result.base_gguf, "sha256": sha256_file(bases[0][0])}
                                  if base_gguf else None),
                    "converter": result.converter, "verification": result.to_dict(),
                    "files": {p.name: file_record(p) for p in sorted(staged.iterdir()) if p.is_file()}}
        (staged / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        commit_folder(staged, final)
    log.info("gguf-adapter: %s (%s)", final, result.summary())
    return result


def _record(conv: Any, base_too: bool) -> dict[str, str]:
    """The converter's record (llama-cpp-python version, llama.cpp commit, sdist sha256), naming the scripts run."""
    scripts = "convert_lora_to_gguf.py" + (", convert_hf_to_gguf.py (the base)" if base_too else "")
    return {**conv.record(), "converter": f"llama.cpp {scripts}"}
