"""Export task: any training checkpoint (local or S3) to verified SafeTensors, ONNX, GGUF, with a Prefect artifact."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from memfit.release.from_checkpoint import export_checkpoint


@task(name="export-checkpoint", cache_policy=NO_CACHE, timeout_seconds=7200)
def export_checkpoint_task(checkpoint_uri: str, out_dir: str, onnx: bool = True, upload_uri: str | None = None,
                           gguf_quants: list[str] | None = None) -> dict[str, Any]:
    report = export_checkpoint(checkpoint_uri, out_dir, onnx=onnx, upload_uri=upload_uri, gguf=bool(gguf_quants),
                               gguf_quants=gguf_quants)
    gguf_row = "; ".join(f"`{f['file']}` top-1 {f['top1_agree']:.1%}, greedy {f['greedy_equal']}/{f['prompts']}"
                         for f in (report["gguf"] or {}).get("files", [])) or "off"
    parity = ", ".join(f"{p['batch']}×{p['seq']}: {p['max_abs_diff']:.2e}" for p in report["onnx_parity"] or [])
    onnx_row = (f"`{report['onnx_path']}` (opset {report['onnx_opset']}; max abs diff "
                f"{report['onnx_max_abs_diff']:.2e} ≤ {report['onnx_atol']:g}; per shape {parity})"
                if report["onnx_path"] else "off")
    create_markdown_artifact(
        key="export-checkpoint",
        description="Verified export of a training checkpoint",
        markdown="\n".join([
            "# Export", "", "| what | value |", "|---|---|",
            f"| training checkpoint | `{report['checkpoint']}` (step {report['step']}) |",
            f"| SafeTensors folder | `{report['safetensors_dir']}` (reload diff "
            f"{report['safetensors_max_abs_diff']:.2e}) |",
            f"| ONNX | {onnx_row} |",
            f"| GGUF (llama.cpp vs transformers) | {gguf_row} |",
            f"| uploaded to | {report['uploaded_uri'] or '—'} |",
        ]),
    )
    return report
