"""The LoRA adapter alone (a peft folder) for multi-LoRA serving, verified with peft against the merged export."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.errors import ExportError
from memfit.files import commit_folder, file_record, sha256_file, staged_folder
from memfit.runtime.importing import skip_deepspeed_probe

ADAPTER_DIR = "adapter"
MANIFEST_NAME = "memfit-adapter.json"  # written last: a folder without it is not a finished export
VERIFY_SHAPES = ((1, 8), (2, 16))
log = logging.getLogger("memfit.release")


@dataclass
class AdapterExport:
    """A written and verified adapter folder: where, what base it needs, and how close base + adapter came."""

    dir: str
    base: str
    base_sha256: str | None
    base_quantization: str
    max_abs_diff: float
    max_kl: float
    top1_agree: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def base_statement(quantization: str) -> str:
    """The base the adapter needs, in words for tags and summaries: a QLoRA adapter matches its base only when
    that base is loaded in 4-bit NF4, as it was trained on it."""
    return "4-bit NF4 base (bitsandbytes)" if quantization == "nf4" else "unquantized base"


def base_digest(source: str) -> str | None:
    """sha256 over the base's weight files (name and digest of each, sorted), when the base is a local folder;
    None for a hub id (its revision pins it)."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    joined = "".join(f"{p.name}:{sha256_file(p)}\n" for p in files)
    return hashlib.sha256(joined.encode()).hexdigest() if files else None


def write_adapter(adapted: Any, tokenizer: Any, final: Path, base: str, quantization: str) -> Path:
    """The peft folder (adapter_config.json, adapter_model.safetensors), the tokenizer and its chat template, and
    memfit-adapter.json (the base and its checksum, file checksums) last; staged beside `final`, then renamed."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(final) as staged:
        try:
            skip_deepspeed_probe()
            adapted.save_pretrained(str(staged), safe_serialization=True)
            tokenizer.save_pretrained(str(staged))
        except OSError as err:
            raise ExportError(f"writing the adapter to {final} failed: {err}; check free disk space") from None
        cfg_path = staged / "adapter_config.json"
        doc = json.loads(cfg_path.read_text())
        doc["base_model_name_or_path"] = base  # where the base was loaded from, not a temporary name
        cfg_path.write_text(json.dumps(doc, indent=2, sort_keys=True))
        manifest = {"memfit_version": memfit.__version__, "format": "peft-lora", "base_model": base,
                    "base_sha256": base_digest(base), "base_quantization": quantization,
                    "files": {p.name: file_record(p) for p in sorted(staged.iterdir()) if p.is_file()}}
        (staged / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        commit_folder(staged, final)
    return final


@torch.no_grad()
def verify_adapter(folder: Path, merged: torch.nn.Module, base: str, quantization: str,
                   criteria: Any) -> AdapterExport:
    """Load the base as a user would (the same folder or hub id; NF4 round trip for a QLoRA base), put the adapter
    on it with peft, and compare its logits with the merged model's at fixed inputs (the ONNX parity limits)."""
    from memfit.models.loading import load_model
    from memfit.models.lora import peft_quietly
    from memfit.models.quantization import quantization_for
    from memfit.release.formats import sample_ids
    from memfit.release.parity import parity_failure, shape_parity

    model = load_model(base, dtype=torch.float32)
    policy = quantization_for(quantization, "fp32")
    if policy is not None:
        model = policy.round_trip(model)
    with peft_quietly():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder)).eval()
    merged_device = next(merged.parameters()).device
    was_training = merged.training
    merged.eval()
    vocab = int(merged.get_output_embeddings().weight.shape[0])
    figures = []
    for seed, (batch, seq) in enumerate(VERIFY_SHAPES):
        ids = sample_ids(vocab, batch, seq, seed)
        ref = merged(input_ids=ids.to(merged_device)).logits.float().cpu().numpy()
        got = model(input_ids=ids).logits.float().cpu().numpy()
        figures.append(shape_parity(ref, got))
    merged.train(was_training)
    problem = parity_failure(f"the adapter on its base ({folder})", figures, criteria)
    if problem:
        raise ExportError(problem)
    agree = sum(p.top1_agree for p in figures) / sum(p.positions for p in figures)
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    return AdapterExport(dir=str(folder), base=base, base_sha256=doc["base_sha256"], base_quantization=quantization,
                         max_abs_diff=max(p.max_abs_diff for p in figures), max_kl=max(p.max_kl for p in figures),
                         top1_agree=agree)
