"""Phase 5 task: validation loss and perplexity, then verified SafeTensors and ONNX exports."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from memfit import phases
from memfit.config import MemfitConfig
from memfit.release.adapter import base_statement
from memfit.reports import ExportReport, TrainReport


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


@task(name="evaluate-and-export", cache_policy=NO_CACHE, timeout_seconds=3600)
def export_task(config: MemfitConfig, trained: TrainReport) -> ExportReport:
    report = phases.evaluate_and_release(config, trained)
    onnx = (f"`{report.onnx_path}` (opset {report.onnx_opset}, max abs diff {report.onnx_max_abs_diff:.2e})"
            if report.onnx_path else f"**failed**: {report.onnx_error}" if report.onnx_error else "off")
    create_markdown_artifact(
        key="eval-and-export",
        description="Evaluation and verified exports",
        markdown="\n".join([
            "# Evaluation and export", "", "| what | value |", "|---|---|",
            f"| validation loss | {_or_nan(trained.initial_val_loss):.4f}"
            f" → {report.final_val_loss:.4f} |",
            f"| perplexity | {report.final_val_perplexity:.3f} |",
            f"| SafeTensors folder | `{report.safetensors_dir}` (reload diff {report.safetensors_max_abs_diff:.2e}) |",
            f"| ONNX | {onnx} |",
            *_format_rows(report),
            f"| from training checkpoint | `{report.source_checkpoint}` |",
            f"| MLflow run | `{trained.mlflow_run_id}` |",
            *_registry_rows(report),
        ]),
    )
    _link_mlflow_run(config, trained.mlflow_run_id)
    return report


def _link_mlflow_run(config: MemfitConfig, run_id: str) -> None:
    if config.tracking.backend != "mlflow" or not run_id:
        return
    from memfit.tracking.mlflow_tracker import run_url

    uri = config.tracking.resolved_uri()
    url = run_url(uri, run_id)
    if url:
        create_link_artifact(key="mlflow-run", link=url, link_text=f"MLflow run {run_id}")
    else:
        create_markdown_artifact(key="mlflow-run", description="Where the MLflow run is", markdown=(
            f"MLflow run `{run_id}` is in the local store `{uri}`.\n\n"
            f"Open it with `mlflow ui --backend-store-uri {uri}` and browse to the run id."))


def _format_rows(report: ExportReport) -> list[str]:
    """The adapter and GGUF exports with their checks, and the scores the gate read (tasks, sets, DPO pairs)."""
    rows = []
    if report.adapter:
        a = report.adapter
        rows.append(f"| LoRA adapter | `{a['dir']}` (peft on its {base_statement(a['base_quantization'])}: max abs "
                    f"diff {a['max_abs_diff']:.2e}, top-1 {a['top1_agree']:.1%}) |")
    if report.gguf:
        files = "; ".join(f"`{f['file']}` top-1 {f['top1_agree']:.1%}, greedy {f['greedy_equal']}/{f['prompts']}"
                          for f in report.gguf["files"])
        rows.append(f"| GGUF (llama.cpp vs transformers) | {files} |")
    rows += [f"| {k} | {v:.4f} |" for k, v in sorted(report.task_scores.items())
             if k.startswith(("eval/", "champion/eval/")) and not k.endswith(("_stderr", "/examples", "/pairs"))]
    return rows


def _registry_rows(report: ExportReport) -> list[str]:
    rows = [f"| uploaded to | `{report.export_uri}` |"] if report.export_uri else []
    r = report.registry
    if r:
        verdict = "passed" if r["gate_passed"] else "**failed**"
        rows.append(f"| eval gate | {verdict}: {r['gate_reason']} |")
        rows.append(f"| registered | `{r['model_name']}` version {r['version']} → alias `{r['alias']}` |"
                    if r["version"] else "| registered | no (the champion is unchanged) |")
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one table cell
    rows += [f"| sample: `{cell(g['prompt'])}` | `{cell(g['completion'])}` |" for g in report.generations[:5]]
    return rows
