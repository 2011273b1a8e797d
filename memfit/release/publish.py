"""Phase 5 after evaluation: verified exports, their upload and MLflow artifacts, the gate and the registry."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from memfit.config import MemfitConfig
from memfit.evaluation.judge import judge
from memfit.evaluation.review import run_description
from memfit.release.adapter import AdapterExport, base_statement
from memfit.release.from_checkpoint import ExportFiles, export_model, onnx_redo_command, parity_criteria
from memfit.release.registry import RegistryOutcome, publish_on_tracker
from memfit.release.uploads import upload_export
from memfit.reports import ExportReport
from memfit.runtime.env import resolve_device
from memfit.tracking.mlflow_tracker import MLflowTracker
from memfit.tracking.process import ProcessTracker
from memfit.tracking.records import log_loss_curve, on_tracker

log = logging.getLogger("memfit.release")


def release(cfg: MemfitConfig, tracker: Any, model: Any, tokenizer: Any, meta: dict[str, Any],
            metrics: dict[str, float], step: int, adapter: AdapterExport | None = None, pairs: Any = None,
            peft: Any = None) -> ExportReport:
    """Verified exports, their upload and MLflow artifacts, the loss curve, then the gate and the registry.
    `pairs`: a DPO run's held-out preference pairs (rows, fields), scored on the export and the champion.
    `peft`: a LoRA run's peft folder and base (gguf_adapter.PeftSource), for export.formats gguf-adapter.

    A failed ONNX export does not stop the rest: the report's `onnx_error` says what failed and how to redo it.
    """
    files = export_model(model, tokenizer, cfg.export.dir, onnx=cfg.export.onnx, criteria=parity_criteria(cfg.export),
                         opset=cfg.export.opset, metadata=meta, dtype=cfg.export.dtype)
    files.adapter_dir = adapter.dir if adapter is not None else None  # verified in phase 5 before this
    gguf = None
    if "gguf" in cfg.export.enabled_formats():  # from the SafeTensors folder just verified, checked by llama.cpp
        from memfit.release.gguf_export import GGUF_DIR, export_gguf

        gguf = export_gguf(files.safetensors_dir, Path(cfg.export.dir) / GGUF_DIR, cfg.export.gguf_quants,
                           prompts=cfg.eval.prompts, min_top1=cfg.export.gguf_min_top1.model_dump(),
                           max_new_tokens=cfg.eval.max_new_tokens, name=cfg.run.name,
                           converter=cfg.export.gguf_converter)
        tracker.log_metrics(gguf.metrics(), step=step)
        files.gguf_dir = gguf.dir
    gguf_adapter = None
    if peft is not None and "gguf-adapter" in cfg.export.enabled_formats():  # checked by llama.cpp vs the merged
        from memfit.release.gguf_adapter import ADAPTER_GGUF_DIR, export_gguf_adapter

        gguf_adapter = export_gguf_adapter(
            peft, files.safetensors_dir, Path(cfg.export.dir) / ADAPTER_GGUF_DIR, cfg.export.gguf_quants,
            prompts=cfg.eval.prompts, min_top1=cfg.export.gguf_min_top1.model_dump(),
            max_new_tokens=cfg.eval.max_new_tokens, base_gguf=cfg.export.gguf_adapter_base,
            converter=cfg.export.gguf_converter)
        tracker.log_metrics(gguf_adapter.metrics(), step=step)
        files.gguf_adapter_dir = gguf_adapter.dir
    task_scores: dict[str, float] = {}
    if cfg.eval.tasks or cfg.eval.sets or pairs is not None:  # the export as users load it, and the champion
        task_scores = judge(cfg, files.safetensors_dir, str(resolve_device(cfg.train.device)), tracker, step,
                            Path(cfg.run.work_dir) / "eval" / str(meta["mlflow_run_id"]), str(meta["mlflow_run_id"]),
                            pairs)
        metrics = {**metrics, **task_scores}
    tags = format_tags(files, adapter, gguf, gguf_adapter)
    onnx_error = None
    if files.onnx_max_abs_diff is not None:
        worst = max(files.onnx_parity, key=lambda p: p["relative"])
        tracker.log_metrics({"onnx_max_abs_diff": files.onnx_max_abs_diff, "onnx_max_relative_diff": worst["relative"],
                             "onnx_max_kl": max(p["max_kl"] for p in files.onnx_parity)}, step=step)
    if files.onnx_error:
        redo = onnx_redo_command(meta["source_checkpoint"], files.dir)
        onnx_error = (f"{files.onnx_error} The SafeTensors export, evaluation, MLflow run and registry steps "
                      f"completed; redo only the ONNX with `{redo}`.")
        tags["memfit.onnx_error"] = onnx_error[:4000]
        tracker.set_tags({"memfit.onnx_error": tags["memfit.onnx_error"]})  # now: visible even if a later step fails
    if cfg.export.uri:  # one folder per run (every verified format): a failed gate never overwrites the champion's
        target = f"{cfg.export.uri.rstrip('/')}/{meta['mlflow_run_id']}"
        files.uploaded_uri = upload_export(files, target, meta)
        tags["memfit.export_uri"] = files.uploaded_uri
    outcome = None
    if cfg.registry.enabled and isinstance(tracker, (MLflowTracker, ProcessTracker)):
        version_tags = {"memfit.source_checkpoint": str(meta["source_checkpoint"]), "memfit.step": str(step),
                        **({"memfit.onnx_max_abs_diff": str(files.onnx_max_abs_diff)} if files.onnx_path else {}),
                        **tags}
        # Where the store is open: the tracking process in `memfit run` (records.py).
        outcome = RegistryOutcome(**on_tracker(
            tracker, publish_on_tracker, str(files.safetensors_dir), metrics, cfg.registry.model_name or cfg.run.name,
            cfg.eval.gate.model_dump(), cfg.registry.alias, version_tags))
        tags.update({"memfit.gate": "passed" if outcome.gate_passed else "failed",
                     "memfit.gate.reason": outcome.gate_reason})
    elif cfg.registry.enabled:
        log.info("registry skipped: it needs the MLflow tracker (%s)", tracker.describe())
    log_export_artifacts(tracker, files, weights_in_model=outcome is not None)
    if adapter is not None:  # the peft folder for multi-LoRA serving, and how close base + adapter came
        tracker.log_metrics({"adapter_max_abs_diff": adapter.max_abs_diff, "adapter_max_kl": adapter.max_kl}, step)
        tracker.log_artifact(adapter.dir, "export/adapter")
    if gguf is not None:
        tracker.log_artifact(gguf.dir, "export/gguf")
    if gguf_adapter is not None:
        tracker.log_artifact(gguf_adapter.dir, "export/gguf-adapter")
    on_tracker(tracker, log_loss_curve, cfg.run.name)
    summary = {"val_loss": round(metrics["val_loss"], 5), "val_perplexity": round(metrics["val_perplexity"], 4),
               "onnx_max_abs_diff": files.onnx_max_abs_diff, "onnx_error": files.onnx_error,
               "export": files.dir, "uploaded_to": files.uploaded_uri,
               **({"adapter": adapter.dir, "adapter_max_abs_diff": adapter.max_abs_diff} if adapter else {}),
               **({"gguf": gguf.dir} if gguf else {}),
               **({"gguf_adapter": gguf_adapter.dir} if gguf_adapter else {}),
               **{k: round(v, 4) for k, v in task_scores.items()
                  if k.startswith("eval/") and not k.endswith(("_stderr", "/examples"))},
               **({"gate": outcome.gate_reason, "registered": f"{outcome.model_name} v{outcome.version}"
                   if outcome.version else "no"} if outcome else {})}
    tracker.set_tags({**tags, "memfit.status": "completed", "mlflow.note.content": run_description(summary)})
    return ExportReport(final_val_loss=metrics["val_loss"], final_val_perplexity=metrics["val_perplexity"],
                        safetensors_dir=files.safetensors_dir, safetensors_max_abs_diff=files.safetensors_max_abs_diff,
                        onnx_path=files.onnx_path, onnx_max_abs_diff=files.onnx_max_abs_diff,
                        onnx_opset=files.onnx_opset, source_checkpoint=str(meta["source_checkpoint"]),
                        export_uri=files.uploaded_uri, registry=outcome.to_dict() if outcome else None,
                        onnx_error=onnx_error, task_scores=task_scores,
                        adapter=adapter.to_dict() if adapter else None, gguf=gguf.to_dict() if gguf else None,
                        gguf_adapter=gguf_adapter.to_dict() if gguf_adapter else None)


def format_tags(files: ExportFiles, adapter: AdapterExport | None, gguf: Any, gguf_adapter: Any = None
                ) -> dict[str, str]:
    """memfit.format.NAME per written format, with its verification figures: on the run and the registry version."""
    tags = {"memfit.formats": ",".join(n for n, done in (("safetensors", True), ("onnx", files.onnx_path),
                                                        ("adapter", adapter), ("gguf", gguf),
                                                        ("gguf-adapter", gguf_adapter)) if done),
            "memfit.format.safetensors": f"reloaded max |diff| {files.safetensors_max_abs_diff:.2e}"}
    if files.onnx_path:
        tags["memfit.format.onnx"] = f"onnxruntime parity max |diff| {files.onnx_max_abs_diff:.2e}"
    if adapter is not None:
        tags["memfit.format.adapter"] = (f"peft on its {base_statement(adapter.base_quantization)} vs merged: "
                                         f"max |diff| {adapter.max_abs_diff:.2e}, top-1 {adapter.top1_agree:.1%}")
    if gguf is not None:
        tags["memfit.format.gguf"] = "; ".join(
            f"{f.quant}: greedy {f.greedy_equal}/{f.prompts}, top-1 {f.top1_agree:.1%}, max KL {f.max_kl:.2g}"
            for f in gguf.files) + f"; chat template equal: {gguf.chat_template_equal}"
    if gguf_adapter is not None:
        tags["memfit.format.gguf-adapter"] = gguf_adapter.summary()
    return tags


def log_export_artifacts(tracker: Any, files: ExportFiles, weights_in_model: bool) -> None:
    """export/hf (without the weights when the logged model already holds them) and export/onnx in the run."""
    hf = Path(files.safetensors_dir)
    if weights_in_model:
        with tempfile.TemporaryDirectory(prefix="memfit-hf-meta-") as tmp:
            for p in hf.iterdir():
                if p.is_file() and p.suffix != ".safetensors":
                    shutil.copy2(p, Path(tmp) / p.name)
            tracker.log_artifact(tmp, "export/hf")
    else:
        tracker.log_artifact(hf, "export/hf")
    if files.onnx_path:
        onnx = Path(files.onnx_path)
        for p in (onnx, onnx.with_name(onnx.name + ".data"), onnx.with_name(onnx.name + ".memfit.json")):
            if p.is_file():
                tracker.log_artifact(p, "export/onnx")
