"""GGUF export: written by llama.cpp's converter, quantized and verified by llama.cpp itself against transformers."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import memfit
from memfit.errors import ExportError
from memfit.files import commit_folder, file_record, staged_folder

GGUF_DIR = "gguf"
MANIFEST_NAME = "memfit-gguf.json"  # written last: a folder without it is not a finished export
CHAT_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three"},
              {"role": "assistant", "content": "four five"}, {"role": "user", "content": "the red fox"}]
log = logging.getLogger("memfit.release")


@dataclass
class QuantFigures:
    """One GGUF file against transformers on the same token sequences (prompt + transformers' greedy tokens)."""

    quant: str
    file: str
    bytes: int
    greedy_equal: int  # prompts whose greedy continuation from llama.cpp equals transformers'
    prompts: int
    top1_agree: float  # fraction of teacher-forced positions with the same arg-max
    max_abs_diff: float
    max_kl: float


@dataclass
class GgufExport:
    """A written and verified GGUF folder: its files, the Modelfile, and each file's figures."""

    dir: str
    architecture: str
    files: list[QuantFigures] = field(default_factory=list)
    modelfile: str = ""
    modelfile_template: bool = False
    chat_template_equal: bool | None = None  # None: the tokenizer has no chat template

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        out = {}
        for f in self.files:
            out.update({f"gguf_{f.quant}_top1_agree": f.top1_agree, f"gguf_{f.quant}_max_kl": f.max_kl,
                        f"gguf_{f.quant}_greedy_equal": f.greedy_equal / f.prompts, f"gguf_{f.quant}_bytes": f.bytes})
        return out


def export_gguf(hf_dir: str | Path, final: str | Path, quants: list[str], *, prompts: list[str],
                min_top1: dict[str, float], max_new_tokens: int = 16, name: str = "memfit",
                converter: str | Path | None = None) -> GgufExport:
    """hf_dir (a merged SafeTensors folder) → final/model-QUANT.gguf for each quant: f16 by llama.cpp's own
    converter (`converter`: export.gguf_converter, else the install), quantized by llama.cpp, verified, with a
    Modelfile; staged beside `final`, memfit-gguf.json (naming the converter) written last, then renamed into place."""
    from transformers import AutoTokenizer

    from memfit.release.gguf import check_gguf_export, quantize
    from memfit.release.gguf_converter import find
    from memfit.release.modelfile import MODELFILE_NAME, modelfile_text

    hf_dir, final = Path(hf_dir), Path(final).absolute()
    cfg = json.loads((hf_dir / "config.json").read_text())
    check_gguf_export(cfg, quants, converter)
    conv = find(converter)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(final) as staged:
        f16 = staged / "model-f16.gguf"
        convert_f16(conv, hf_dir, f16, _model_name(name, tokenizer))
        for quant in quants:
            if quant != "f16":
                quantize(f16, staged / f"model-{quant}.gguf", quant)
        ref = _reference(hf_dir, tokenizer, prompts, max_new_tokens)
        result = GgufExport(dir=str(final), architecture=_architecture(f16))
        for quant in quants:
            path = staged / f"model-{quant}.gguf"
            figures, template_equal = verify_file(path, quant, tokenizer, ref)
            result.files.append(figures)
            result.chat_template_equal = template_equal
            judge(figures, min_top1, tokenizer.chat_template, template_equal)
        if "f16" not in quants:
            f16.unlink()
        served = next((q for q in quants if q != "f16"), "f16")
        context = cfg.get("max_position_embeddings") or cfg.get("n_positions") or 4096
        text, result.modelfile_template = modelfile_text(f"model-{served}.gguf", tokenizer, min(int(context), 4096))
        (staged / MODELFILE_NAME).write_text(text)
        result.modelfile = str(final / MODELFILE_NAME)
        for f in result.files:  # where they will be once renamed into place
            f.file = str(final / Path(f.file).name)
        manifest = {"memfit_version": memfit.__version__, "format": "gguf", "converter": conv.record(),
                    "verification": result.to_dict(),
                    "files": {p.name: file_record(p) for p in sorted(staged.iterdir()) if p.is_file()}}
        (staged / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        commit_folder(staged, final)
    return result


def convert_f16(conv: Any, hf_dir: Path, out: Path, name: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py: the SafeTensors folder → one f16 GGUF, with memfit's pre-tokenizer name
    as the fallback for a tokenizer its hash table does not know (memfit.release.gguf_runner)."""
    from memfit.release.gguf import pre_tokenizer, tokenizer_doc
    from memfit.release.gguf_converter import run

    started = time.perf_counter()
    run(conv, "convert_hf_to_gguf.py", [str(hf_dir), "--outtype", "f16", "--outfile", str(out), "--model-name",
                                        name], pre_tokenizer=pre_tokenizer(tokenizer_doc(hf_dir)))
    log.info("gguf: llama.cpp's converter wrote %s in %.1f s", out.name, time.perf_counter() - started)


def _model_name(name: str, tokenizer: Any) -> str:
    """general.name as written. llama.cpp sets Phi-3's special-token attributes by the name (llama-vocab.cpp: a name
    holding "phi3" or "phi-3" must have <s>, </s>, <unk> and <|endoftext|> in its vocabulary, or loading fails);
    a run named so whose tokenizer lacks them is written under the name without that word."""
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in ("<s>", "</s>", "<unk>", "<|endoftext|>")):
        return name
    return re.sub(r"(?i)phi-?3", "phi 3", name)


def _architecture(path: Path) -> str:
    """general.architecture of a GGUF file (llama.cpp's name of the family), its vocabulary alone loaded."""
    from memfit.release.llama_loader import open_gguf

    llm = open_gguf(str(path), vocab_only=True, verbose=False)
    try:
        return str(llm.metadata.get("general.architecture", ""))
    finally:
        llm.close()


def judge(f: QuantFigures, min_top1: dict[str, float], template: str | None, template_equal: bool | None, *,
          what: str | None = None, reference: str = "transformers",
          meaning: str = "the conversion does not compute the trained model") -> None:
    """The rules a GGUF file passes (also base + adapter, gguf_adapter.py): f16 gives the reference's greedy tokens
    on every prompt, every file reaches its top-1 bound, a chat template renders as the tokenizer's."""
    what = what or f"gguf: {Path(f.file).name}"
    owner = reference + ("'" if reference.endswith("s") else "'s")
    if f.quant == "f16" and f.greedy_equal < f.prompts:
        raise ExportError(f"{what}: llama.cpp's greedy tokens differ from {owner} on "
                          f"{f.prompts - f.greedy_equal} of {f.prompts} prompts (top-1 agreement {f.top1_agree:.1%}, "
                          f"max KL {f.max_kl:.2g}): {meaning}")
    bound = min_top1.get(f.quant, 0.0)
    if not f.top1_agree >= bound:
        raise ExportError(f"{what}: top-1 agreement with {reference} {f.top1_agree:.1%} is below "
                          f"export.gguf_min_top1.{f.quant} = {bound:.0%} (max KL {f.max_kl:.2g})")
    if template and template_equal is False:
        raise ExportError(f"{what}: the chat template in the GGUF renders a conversation differently from "
                          "the tokenizer's")


def _reference(hf_dir: Path, tokenizer: Any, prompts: list[str], new: int) -> list[dict[str, Any]]:
    """transformers (fp32) on each prompt: its token ids, greedy continuation, and logits along the whole."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(tokenizer(prompt)["input_ids"])
            seq = list(ids)
            for _ in range(new):  # plain arg-max, eos included: both runtimes see the same rule
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            logits = model(input_ids=torch.tensor([seq])).logits[0].double().numpy()
            out.append({"prompt": prompt, "ids": ids, "greedy": seq[len(ids):], "seq": seq, "logits": logits})
    return out


def verify_file(path: Path, quant: str, tokenizer: Any, ref: list[dict[str, Any]],
                lora: Path | None = None) -> tuple[QuantFigures, bool | None]:
    """Load `path` with llama.cpp as a user would; its tokens, greedy continuations and logits against `ref`; its
    chat template (from the GGUF) rendered by llama-cpp-python's Jinja formatter against the tokenizer's. `lora`: a
    GGUF LoRA adapter llama.cpp applies on the model (export.formats gguf-adapter)."""
    import numpy as np

    from memfit.release.llama_loader import open_gguf
    from memfit.release.parity import shape_parity

    longest = max(len(r["seq"]) for r in ref)
    llm = open_gguf(str(path), n_ctx=max(64, longest + 8), logits_all=True, verbose=False, seed=0,
                lora_path=str(lora) if lora else None, n_threads=max(1, min(4, os.cpu_count() or 1)))
    greedy, agree, positions, diff, kl = 0, 0, 0, 0.0, 0.0
    try:
        for r in ref:
            ids = llm.tokenize(r["prompt"].encode(), add_bos=True, special=True)
            if list(ids) != r["ids"]:
                raise ExportError(f"gguf: {path.name}: llama.cpp tokenizes {r['prompt']!r} as {list(ids)}, the "
                                  f"tokenizer as {r['ids']}")
            llm.reset()
            llm.eval(r["ids"])
            seq = list(r["ids"])
            for _ in range(len(r["greedy"])):
                seq.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([seq[-1]])
            greedy += seq[len(r["ids"]):] == r["greedy"]
            llm.reset()
            llm.eval(r["seq"])
            got = np.array(llm.scores[: len(r["seq"])], dtype=np.float64)
            p = shape_parity(r["logits"][None], got[None])
            agree, positions = agree + p.top1_agree, positions + p.positions
            diff, kl = max(diff, p.max_abs_diff), max(kl, p.max_kl)
        template_equal = _template_equal(llm, tokenizer)
    finally:
        llm.close()
    figures = QuantFigures(quant=quant, file=str(path), bytes=path.stat().st_size, greedy_equal=greedy,
                           prompts=len(ref), top1_agree=agree / positions, max_abs_diff=diff, max_kl=kl)
    return figures, template_equal


def _template_equal(llm: Any, tokenizer: Any) -> bool | None:
    if not tokenizer.chat_template:
        return None
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return False
    fmt = Jinja2ChatFormatter(template=template, eos_token=tokenizer.eos_token or "",
                              bos_token=tokenizer.bos_token or "", add_generation_prompt=True)
    want = tokenizer.apply_chat_template(CHAT_PROBE, tokenize=False, add_generation_prompt=True)
    return fmt(messages=CHAT_PROBE).prompt == want
