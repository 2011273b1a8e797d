"""A run's commands: the whole flow (run), one phase alone (probe, profile, launch-node), the resolved config."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer

from memfit.cli.common import PROCESS, ConfigArg, DebugOpt, JsonOpt, SetOpt, environment, fail, load, phase
from memfit.errors import MemfitError, OnnxExportFailed
from memfit.runtime.importing import collector_paused


def run(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Run the five-phase fine-tune flow (ephemeral Prefect unless PREFECT_API_URL is set)."""
    environment()
    quiet = None
    guard = PROCESS.guard
    try:
        cfg = load(config, set_)
        if guard is not None:
            guard.grace_s = cfg.checkpoint.grace_seconds
        with collector_paused(freeze=PROCESS.own):  # the start-up's imports (memfit/runtime/importing.py)
            from memfit.preflight import preflight

            # Missing data or model, unwritable outputs, a missing bucket, bad credentials: one line, in seconds,
            # before Prefect starts.
            preflight(cfg)
            from flows.ephemeral import start_ephemeral_server

            # No PREFECT_API_URL: the server boots in a process of its own from here on, while this one imports
            # torch, the flow and Prefect (nothing heavy is imported before this line; tests check it).
            server = start_ephemeral_server()
            from memfit.tracking.process import prestart

            if cfg.distributed.world_size == 1:  # torchrun's ranks log from the launcher and rank 0, as before
                prestart(cfg.tracking)  # MLflow's imports and store set-up, in a process beside the server's
            from flows.console import quiet_expected_errors
            from flows.finetune import finetune
            from flows.startup import warm_up

            _stop_if_signalled()  # a Ctrl-C during those imports may have been swallowed (ExitGuard.check)

            if not debug:
                quiet = quiet_expected_errors(Path(cfg.run.work_dir) / "logs" / "errors.log",
                                              lambda: guard is not None and guard.signalled)
            # What the phases would import and open later, done while the server still boots (not once it answers).
            warm_up(cfg, server.answers if server is not None else lambda: True)
        with server.serving() if server is not None else nullcontext():
            _stop_if_signalled()
            summary = finetune(config=cfg)
    except OnnxExportFailed as err:  # everything else is done: the summary first, then the one line
        print_summary(err.summary, as_json)
        fail(err)
    except MemfitError as err:
        fail(err, f" (traceback: {quiet.log_file}; --debug shows it here)" if quiet and quiet.holds(err) else "")
    except BaseException:
        if guard is not None and guard.signalled:  # Prefect's TerminationSignal, a second Ctrl-C, ...
            from memfit.runtime.termination import Interrupted

            fail(Interrupted.by(guard.signal_name))
        raise
    finally:
        if quiet is not None:
            from flows.console import remove_filters

            remove_filters()
    print_summary(summary, as_json)


def _stop_if_signalled() -> None:
    if PROCESS.guard is not None:
        PROCESS.guard.check()


def print_summary(summary: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(summary.model_dump(mode="json"), sort_keys=True))
        return
    typer.echo(f"done: {summary.steps} steps, val loss {summary.initial_val_loss:.4f} -> "
               f"{summary.final_val_loss:.4f}; MLflow run {summary.mlflow_run_id} at {summary.tracking_uri}; "
               f"export {summary.safetensors_dir}" + (f" + {summary.onnx_path}" if summary.onnx_path else ""))
    if summary.gate_passed is not None:
        typer.echo(f"eval gate {'passed' if summary.gate_passed else 'FAILED'} ({summary.gate_reason}); "
                   + (f"registered {summary.registered_model} version {summary.model_version}"
                      if summary.model_version else "nothing registered"))


def probe(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Phase 1 alone: environment report and one real plain training step against the memory budget."""
    _, report = phase(config, set_, "check_environment_and_probe")
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), sort_keys=True))
    else:
        b = report.baseline
        typer.echo(f"{report.environment['device']['type']} {report.environment['device']['name']}: {b['message']}")


def profile(
    config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False,
    steps: Annotated[int, typer.Option(min=2, help="Optimizer steps per policy; the last one is recorded.")] = 3,
    out: Annotated[Path | None, typer.Option(help="Output folder. Default: profile/ beside run.work_dir.")] = None,
    compare: Annotated[str | None, typer.Option(help="Policies to compare on one chart, e.g. none,full,selective; "
                                                "auto: the planner's stack. Default: auto alone.")] = None,
    trace: Annotated[bool, typer.Option("--trace", help="Also a torch.profiler Chrome trace on CPU "
                                        "(always on CUDA, with the allocator's memory snapshot).")] = False,
    mlflow_run: Annotated[str | None, typer.Option(help="Log the profile to this MLflow run id, or 'new'.")] = None,
) -> None:
    """Memory over one training step: per-module table (Markdown, JSON), timeline PNGs, policy comparison."""
    environment()
    try:
        cfg = load(config, set_)
        with collector_paused(freeze=PROCESS.own):
            from memfit.profile import profile as run_profile

        names = [n.strip() for n in compare.split(",") if n.strip()] if compare else None
        result = run_profile(cfg, out_dir=out, steps=steps, compare=names, trace=trace, mlflow_run=mlflow_run)
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))
        return
    for name, s in result["policies"].items():
        typer.echo(f"{name:>10}: peak {s['peak_bytes'] / 1e6:9.2f} MB, "
                   f"activations {s['peak_activation_bytes'] / 1e6:9.2f} MB"
                   f" peak, {s['step_seconds']:.3f} s/step, {s['tokens_per_second']:,.0f} tokens/s")
    typer.echo(f"wrote {', '.join(Path(f).name for f in result['files'].values())} to {result['out_dir']}")


def launch_node(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Multi-node runs: start this machine's training ranks (node 0 runs `memfit run`; set distributed.node_rank)."""
    cfg, report = phase(config, set_, "launch_node")
    typer.echo("nothing to do: the run already finished" if report is None else
               f"node {cfg.distributed.node_rank} done at step {report.steps}")


def show_config(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML."""
    try:
        typer.echo(load(config, set_).to_yaml(), nl=False)
    except MemfitError as err:
        fail(err)
