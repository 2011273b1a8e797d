"""Phase 1 task: environment check and the baseline OOM probe."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from memfit import phases
from memfit.config import MemfitConfig
from memfit.reports import ProbeReport

GB = 1e9


@task(name="env-check-and-probe", cache_policy=NO_CACHE, timeout_seconds=3600)
def probe_task(config: MemfitConfig) -> ProbeReport:
    report = phases.check_environment_and_probe(config)
    b, dev = report.baseline, report.environment["device"]
    budget = f"{b['budget_bytes'] / GB:.4f} GB ({b['budget_source']})" if b["budget_bytes"] else b["budget_source"]
    create_markdown_artifact(
        key="baseline-probe",
        description="Environment and baseline OOM probe",
        markdown="\n".join([
            "# Baseline OOM probe",
            f"**{'fits' if b['fits'] else 'would OOM'}** — {b['message']}",
            "",
            "| what | value |", "|---|---|",
            f"| device | {dev['type']} {dev['name']} |",
            f"| device memory total / free | {dev['memory_total_bytes'] / GB:.2f} / "
            f"{dev['memory_free_bytes'] / GB:.2f} GB |",
            f"| bf16 | {dev['bf16_supported']} |",
            f"| model | {report.model_source} ({report.n_params:,} params) |",
            f"| micro-batch × seq | {b['batch_size']} × {b['seq_len']} |",
            f"| peak of one plain step | {b['peak_bytes'] / GB:.4f} GB ({b['method']}) |",
            f"| budget | {budget} |",
            f"| torch / transformers | {report.environment['libraries']['torch']} / "
            f"{report.environment['libraries']['transformers']} |",
        ]),
    )
    return report
