"""The `memfit` command line: run or resume the flow, probe, list/verify training checkpoints, show config."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from memfit.errors import ConfigError, MemfitError, OnnxExportFailed
from memfit.runtime.importing import collector_paused

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune language models on the GPU you have; keep runs alive on spot machines.")
checkpoints_app = typer.Typer(no_args_is_help=True, help="Training checkpoints (saved state to resume from).")
app.add_typer(checkpoints_app, name="checkpoints")

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config (a diff from defaults), e.g. configs/tiny.yaml.")]
SetOpt = Annotated[list[str] | None,
                   typer.Option("--set", help="Override a field: --set train.max_steps=10 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object, last, on stdout.")]


def _environment() -> None:
    """Defaults every entry point shares: telemetry off, memfit logs visible in Prefect, patient start-up."""
    from memfit.runtime.telemetry import set_telemetry_off

    set_telemetry_off()
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "memfit")
    # The ephemeral Prefect server's 20 s default is tight on 2 busy cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "60")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # memfit's lines outside a flow run (preflight, a stop signal) reach the terminal; Prefect's API log handler
    # would warn on each that it cannot send them to a flow run.
    warnings.filterwarnings("ignore", message=r"Logger .* attempted to send logs to the API without a flow run id")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "alembic", "onnxscript", "onnx_ir", "torch.onnx", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(err: BaseException, hint: str = "") -> NoReturn:
    code = getattr(err, "exit_code", 2)
    typer.echo(f"error: {err}{hint}", err=True)
    raise typer.Exit(code)


def _load(config: Path | None, overrides: list[str] | None) -> Any:
    from memfit import config as cfgmod

    return cfgmod.load(config, overrides or [])


def _phase(config: Path | None, overrides: list[str] | None, name: str) -> tuple[Any, Any]:
    """The resolved config and `memfit.phases.<name>(config)` (imported only now: torch comes with it);
    bad input is one line and exit 2."""
    _environment()
    try:
        cfg = _load(config, overrides)
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit import phases

        return cfg, getattr(phases, name)(cfg)
    except MemfitError as err:
        _fail(err)


DebugOpt = Annotated[bool, typer.Option("--debug", help="Show Prefect's tracebacks on the terminal too.")]
_GUARD: Any = None  # the ExitGuard of a real `memfit` process (main()); None in-process (tests, CliRunner)
_OWN_PROCESS = False  # True in a real `memfit` process (main()): its start-up imports may be frozen out of the GC


@app.command()
def run(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Run the five-phase fine-tune flow (ephemeral Prefect unless PREFECT_API_URL is set)."""
    _environment()
    quiet = None
    try:
        cfg = _load(config, set_)
        if _GUARD is not None:
            _GUARD.grace_s = cfg.checkpoint.grace_seconds
        with collector_paused(freeze=_OWN_PROCESS):  # the start-up's imports (memfit/runtime/importing.py)
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
                                              lambda: _GUARD is not None and _GUARD.signalled)
            # What the phases would import and open later, done while the server still boots (not once it answers).
            warm_up(cfg, server.answers if server is not None else lambda: True)
        with server.serving() if server is not None else nullcontext():
            _stop_if_signalled()
            summary = finetune(config=cfg)
    except OnnxExportFailed as err:  # everything else is done: the summary first, then the one line
        _print_summary(err.summary, as_json)
        _fail(err)
    except MemfitError as err:
        _fail(err, f" (traceback: {quiet.log_file}; --debug shows it here)" if quiet and quiet.holds(err) else "")
    except BaseException:
        if _GUARD is not None and _GUARD.signalled:  # Prefect's TerminationSignal, a second Ctrl-C, ...
            from memfit.runtime.termination import Interrupted

            _fail(Interrupted.by(_GUARD.signal_name))
        raise
    finally:
        if quiet is not None:
            from flows.console import remove_filters

            remove_filters()
    _print_summary(summary, as_json)


def _stop_if_signalled() -> None:
    if _GUARD is not None:
        _GUARD.check()


def _print_summary(summary: Any, as_json: bool) -> None:
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


@app.command()
def probe(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Phase 1 alone: environment report and one real plain training step against the memory budget."""
    _, report = _phase(config, set_, "check_environment_and_probe")
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), sort_keys=True))
    else:
        b = report.baseline
        typer.echo(f"{report.environment['device']['type']} {report.environment['device']['name']}: {b['message']}")


@app.command()
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
    _environment()
    try:
        cfg = _load(config, set_)
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.profile import profile as run_profile

        names = [n.strip() for n in compare.split(",") if n.strip()] if compare else None
        result = run_profile(cfg, out_dir=out, steps=steps, compare=names, trace=trace, mlflow_run=mlflow_run)
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))
        return
    for name, s in result["policies"].items():
        typer.echo(f"{name:>10}: peak {s['peak_bytes'] / 1e6:9.2f} MB, "
                   f"activations {s['peak_activation_bytes'] / 1e6:9.2f} MB"
                   f" peak, {s['step_seconds']:.3f} s/step")
    typer.echo(f"wrote {', '.join(Path(f).name for f in result['files'].values())} to {result['out_dir']}")


@app.command()
def serve(config: ConfigArg = None, set_: SetOpt = None,
          limit: Annotated[int | None, typer.Option(help="Most flow runs executed at once by this process.")] = None
          ) -> None:
    """Register the finetune / retrain / export deployments with a Prefect server and run their flow runs."""
    _environment()
    if not os.environ.get("PREFECT_API_URL"):
        typer.echo("error: memfit serve needs a Prefect server: start one (prefect server start --host 127.0.0.1) "
                   "and set PREFECT_API_URL=http://127.0.0.1:4200/api", err=True)
        raise typer.Exit(2)
    try:
        cfg = _load(config, set_)
        with collector_paused(freeze=_OWN_PROCESS):
            from flows.deploy import serve_deployments

        serve_deployments(cfg, limit=limit)
    except MemfitError as err:
        _fail(err)
automations_app = typer.Typer(no_args_is_help=True, help="Prefect automations that restart preempted or vanished "
                               "runs (recovery section).")
app.add_typer(automations_app, name="automations")


@automations_app.command("apply")
def automations_apply(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False,
                      dry_run: Annotated[bool, typer.Option("--dry-run", help="Print them; change nothing.")] = False
                      ) -> None:
    """Create or update memfit's recovery automations on the Prefect server (PREFECT_API_URL); idempotent."""
    _environment()
    try:
        cfg = _load(config, set_)
        from flows.recovery import apply_automations

        rows = apply_automations(cfg, dry_run=dry_run)
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps({"dry_run": dry_run, "automations": rows}))
        return
    for row in rows:
        typer.echo(f"{row.get('applied', 'would apply')}: {row['name']}"
                   + (f"\n  when {row['trigger']}\n  then {row['action']}" if "trigger" in row else ""))


@app.command()
def status(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """A run's attempts (from Prefect), their causes, and how far its training checkpoints got."""
    _environment()
    try:
        cfg = _load(config, set_)
        from flows.recovery import format_status, run_status

        report = run_status(cfg)
    except MemfitError as err:
        _fail(err)
    typer.echo(json.dumps(report) if as_json else format_status(report))


@app.command("serve-model")
def serve_model(
    model: Annotated[str | None, typer.Argument(help="models:/NAME@ALIAS (followed as the alias moves), "
                                                "models:/NAME/N, a training checkpoint, or an export folder. "
                                                "Default: models:/<registry.model_name>@<registry.alias>.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (tracking.uri, registry, "
                                                "serve.*).")] = None,
    set_: SetOpt = None,
    host: Annotated[str | None, typer.Option(help="Listen address (serve.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (serve.port).")] = None,
) -> None:
    """Serve a model behind an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models)."""
    _environment()
    try:
        overrides = list(set_ or []) + [f"serve.{k}={v}" for k, v in (("host", host), ("port", port)) if v]
        cfg = _load(config, overrides)
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.server.run import serve as run_server

        run_server(cfg, model)
    except MemfitError as err:
        _fail(err)


DeviceOpt = Annotated[str | None, typer.Option("--device", help="Target device profile: a100-40gb, a100-80gb, "
                                                "h100-80gb, h200, l4, rtx-4090, t4, cpu.")]
BudgetOpt = Annotated[float | None, typer.Option("--budget-gb", help="Memory budget in GB (overrides the device's).")]


@app.command()
def estimate(config: ConfigArg = None, set_: SetOpt = None, device: DeviceOpt = None, budget_gb: BudgetOpt = None,
             policy: Annotated[str | None, typer.Option("--policy", help="Gradient-checkpointing policy to estimate "
                                                        "(default: memory.policy).")] = None,
             as_json: JsonOpt = False) -> None:
    """Predict the peak memory of one training step (params, grads, optimizer, activations, other) without
    allocating it: the step runs on fake tensors, so any model size works from its config.json alone."""
    _environment()
    try:
        cfg = _load(config, set_)
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.memory.search import estimate_report

        if policy is not None and policy not in ("auto", "none", "full", "every_k", "selective", "offload"):
            raise ConfigError(f"--policy: unknown policy {policy!r}; choose one of auto, none, full, every_k, "
                              "selective, offload")
        out = estimate_report(cfg, device, budget_gb, policy)
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
        return
    from memfit.memory.breakdown import estimate_text

    typer.echo(estimate_text(out))


def _max_seq(config: Any, set_: Any, device: str | None, budget_gb: float | None, as_json: bool) -> None:
    try:
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.memory.search import max_seq_report

        out = max_seq_report(_load(config, set_), device, budget_gb)
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
    else:
        s = out["stack"]
        typer.echo(f"longest data.seq_len that fits {out['limit_bytes'] / 1e9:.4g} GB on {out['device']}: "
                   f"{out['max_seq_len']} tokens with {s['policy']}, {s['precision']}, micro-batch "
                   f"{s['micro_batch_size']}{', LoRA' if s['lora'] else ''}"
                   f"{', NF4 base' if s['quantize'] == 'nf4' else ''}")
        if out["note"]:
            typer.echo(f"note: {out['note']}")
    if out["max_seq_len"] == 0:
        if not as_json:
            typer.echo("error: no sequence length fits the budget with this stack", err=True)
        raise typer.Exit(2)


@app.command()
def plan(config: ConfigArg = None, set_: SetOpt = None, device: DeviceOpt = None, budget_gb: BudgetOpt = None,
         max_seq: Annotated[bool, typer.Option("--max-seq", help="Also report the longest data.seq_len that fits "
                                               "the budget with the chosen stack (a search over estimates).")]
         = False, as_json: JsonOpt = False) -> None:
    """Choose the optimisation stack (checkpointing per block, precision, micro-batch, LoRA, a 4-bit base) that
    fits the budget with the least predicted slowdown, and show the candidates it weighed."""
    _environment()
    if max_seq:
        _max_seq(config, set_, device, budget_gb, as_json)
        return
    try:
        cfg = _load(config, set_)
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.memory.plan import plan_table_markdown
            from memfit.memory.search import plan_report
            from memfit.run_context import measured_peaks_for

        # Stacks this run was stopped at the memory limit with (recovery.on_memory_limit leaner) are out.
        result, out = plan_report(cfg, device, budget_gb, measured=measured_peaks_for(cfg))
        if cfg.distributed.world_size > 1:
            from memfit.memory.search import per_gpu_report

            out["distributed"] = per_gpu_report(cfg, device, budget_gb)
        if cfg.data.packing == "auto":  # the layouts weighed, like the stacks: predicted time per trained token
            from memfit.data.layout import format_layouts
            from memfit.run_context import packing_alternatives

            out["packing"], out["packing_candidates"] = packing_alternatives(cfg, device)
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(out, sort_keys=True))
    else:
        typer.echo(result.reason)
        typer.echo(plan_table_markdown(result))
        if "evaluation" in out:
            typer.echo(out["evaluation"]["line"])
        if "packing" in out:
            typer.echo(format_layouts(out["packing"], out["packing_candidates"]))
        if "distributed" in out and "strategies" in out["distributed"]:
            from memfit.memory.sharding import per_gpu_text

            typer.echo(per_gpu_text(out["distributed"]))
    # Several ranks: what must fit is one GPU's share under the strategy, not a single-process replica.
    fits = out["distributed"].get("fits", False) if "distributed" in out else out["fits"]
    if not fits:
        if not as_json:
            typer.echo(f"error: {out['distributed'].get('error') or 'the per-GPU share does not fit the budget'}"
                       if "distributed" in out else f"error: {out['error']}", err=True)
        raise typer.Exit(2)


@app.command("launch-node")
def launch_node(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Multi-node runs: start this machine's training ranks (node 0 runs `memfit run`; set distributed.node_rank)."""
    cfg, report = _phase(config, set_, "launch_node")
    typer.echo("nothing to do: the run already finished" if report is None else
               f"node {cfg.distributed.node_rank} done at step {report.steps}")


@app.command("config")
def show_config(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML."""
    try:
        typer.echo(_load(config, set_).to_yaml(), nl=False)
    except MemfitError as err:
        _fail(err)


UriArg = Annotated[str, typer.Argument(help="checkpoint.uri: a folder or s3://bucket/prefix.")]
EndpointOpt = Annotated[str | None, typer.Option("--endpoint-url", help="S3-compatible endpoint (else "
                                                 "$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS).")]
RegionOpt = Annotated[str | None, typer.Option("--region", help="S3 region (else $AWS_REGION / profile).")]


def _manager(uri: str, endpoint_url: str | None, region: str | None) -> Any:
    from memfit.checkpoints import CheckpointManager
    from memfit.storage import is_remote, open_store

    opts = {"endpoint_url": endpoint_url, "region": region} if is_remote(uri) else {}
    return CheckpointManager(open_store(uri, **opts))


def _rows(entries: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    done = [{"step": e.step, "uri": e.uri, "bytes": e.info.total_bytes, "created_at": e.info.created_at,
             "status": e.status} for e in entries if e.info is not None]
    partial = [{"step": e.step, "uri": e.uri, "objects": e.objects, "status": e.status}
               for e in entries if e.info is None]
    return done, partial


def _print(uri: str, done: list[dict[str, Any]], partial: list[dict[str, Any]]) -> None:
    import datetime as dt

    if not done:
        typer.echo(f"no complete training checkpoints under {uri}")
    for r in done:
        when = dt.datetime.fromtimestamp(r["created_at"]).isoformat(" ", "seconds") if r["created_at"] else "?"
        typer.echo(f"step {r['step']:>8}  {r['bytes'] / 1e6:10.2f} MB  {when}  {r['status']:<10}  {r['uri']}")
    for r in partial:
        typer.echo(f"step {r['step']:>8}  {r['objects']:>4} object(s), no manifest: incomplete, never loaded  "
                   f"{r['uri']}")


@checkpoints_app.command("ls")
def checkpoints_ls(uri: UriArg, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
                   region: RegionOpt = None) -> None:
    """List training checkpoints: complete ones (with a manifest) with step, size and time; incomplete ones apart."""
    _environment()
    try:
        done, partial = _rows(_manager(uri, endpoint_url, region).scan())
    except MemfitError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps({"uri": uri, "checkpoints": done, "incomplete": partial}))
        return
    _print(uri, done, partial)


@checkpoints_app.command("verify")
def checkpoints_verify(uri: UriArg, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
                       region: RegionOpt = None) -> None:
    """Download every complete training checkpoint and check its sizes and sha256; exit 1 if one is corrupt."""
    import tempfile

    _environment()
    try:
        manager = _manager(uri, endpoint_url, region)
        entries = manager.scan()
        errors: dict[int, str] = {}
        with tempfile.TemporaryDirectory(prefix="memfit-verify-") as tmp:
            for e in entries:
                if e.info is not None:
                    problem = manager.verify(e.info, Path(tmp))
                    e.status = "corrupt" if problem else "verified"
                    if problem:
                        errors[e.step] = problem
    except MemfitError as err:
        _fail(err)
    done, partial = _rows(entries)
    for r in done:
        if r["step"] in errors:
            r["error"] = errors[r["step"]]
    if as_json:
        typer.echo(json.dumps({"uri": uri, "checkpoints": done, "incomplete": partial}))
    else:
        _print(uri, done, partial)
        for step, problem in errors.items():
            typer.echo(f"step {step}: {problem}", err=True)
    if errors:
        raise typer.Exit(1)


@app.command()
def resume(uri: UriArg, set_: SetOpt = None, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
           region: RegionOpt = None) -> None:
    """Continue the run whose training checkpoints are at URI, with the config saved in its newest one."""
    import tempfile

    import yaml

    _environment()
    try:
        manager = _manager(uri, endpoint_url, region)
        complete = manager.list()
        if not complete:
            from memfit.errors import CheckpointError

            raise CheckpointError(f"no complete training checkpoint under {uri} to resume from "
                                  f"(`memfit checkpoints ls {uri}` shows what is there)")
        from memfit.checkpoints import CONFIG_FILE

        stored = yaml.safe_load(manager.store.get_bytes(f"{complete[-1].prefix}/{CONFIG_FILE}").decode())
    except (MemfitError, yaml.YAMLError, UnicodeDecodeError) as err:
        _fail(err)
    # The stored config is data from the store, not from you: remote model code stays off unless --set says so.
    overrides = ["model.trust_remote_code=false", f"checkpoint.uri={uri}"]
    overrides += [f"checkpoint.{k}={v}" for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v]
    with tempfile.TemporaryDirectory(prefix="memfit-resume-") as tmp:
        path = Path(tmp) / "resumed.yaml"
        path.write_text(yaml.safe_dump(stored, sort_keys=False))
        typer.echo(f"resuming {uri} from step {complete[-1].step} with the config saved in {complete[-1].uri}",
                   err=True)
        run(config=path, set_=overrides + list(set_ or []), as_json=as_json)


@app.command("export")
def export_cmd(
    checkpoint_uri: Annotated[str, typer.Argument(help="A training checkpoint: a step-NNNNNNNN folder, or a "
                                                       "checkpoint root (its newest verified one); local or s3://.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder: OUT/hf (SafeTensors) and OUT/model.onnx.")],
    onnx: Annotated[bool, typer.Option("--onnx/--no-onnx", help="Also export ONNX and check its parity.")] = True,
    onnx_only: Annotated[bool, typer.Option("--onnx-only", help="Redo only OUT/model.onnx (e.g. after a run's ONNX "
                                                                "export failed); OUT/hf is left as it is.")] = False,
    set_: SetOpt = None,
    upload: Annotated[str | None, typer.Option("--upload", help="Also upload the export here (folder or "
                                                                "s3://bucket/prefix), manifest last.")] = None,
    adapter: Annotated[bool, typer.Option("--adapter", help="LoRA checkpoints: also write OUT/adapter (a peft "
                                                            "folder), verified with peft on its base.")] = False,
    format_: Annotated[list[str] | None, typer.Option("--format", help="Formats to write (repeat it): "
                                                      "safetensors, onnx, adapter, gguf; SafeTensors always. Given, it "
                                                      "replaces --onnx/--adapter.")] = None,
    quant: Annotated[list[str] | None, typer.Option("--quant", help="GGUF files to write (repeat it): f16, q8_0, "
                                                    "q4_k_m. Unset: the checkpoint's export.gguf_quants.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a training checkpoint to a verified SafeTensors folder and ONNX file (config from the checkpoint)."""
    _environment()
    try:
        with collector_paused(freeze=_OWN_PROCESS):
            from memfit.release.from_checkpoint import export_checkpoint

        if format_:
            unknown = sorted(set(format_) - {"safetensors", "onnx", "adapter", "gguf"})
            if unknown:
                raise ConfigError(f"--format {', '.join(unknown)}: not a format (safetensors, onnx, adapter, gguf)")
            onnx, adapter = "onnx" in format_, "adapter" in format_
        report = export_checkpoint(checkpoint_uri, out, onnx=onnx, onnx_only=onnx_only, upload_uri=upload,
                                   overrides=set_, adapter=adapter, gguf="gguf" in (format_ or []), gguf_quants=quant)
    except MemfitError as err:
        _fail(err)
    from memfit.release.from_checkpoint import export_lines

    lines = export_lines(report)
    for line in lines:  # with --json the human lines go to stderr: stdout is the JSON object alone
        typer.echo(line, err=as_json)
    if as_json:
        typer.echo(json.dumps(report, sort_keys=True, default=str))


def main() -> None:
    """The `memfit` process: a stop signal ends it within the grace period, and nothing at exit can hang it."""
    global _GUARD, _OWN_PROCESS
    from memfit.runtime.termination import EXIT_PREEMPTED, ExitGuard

    _OWN_PROCESS = True

    if sys.argv[1:2] not in (["run"], ["resume"]):
        app()  # the other commands start no flow: Python's own signal handling is right for them
        return
    _GUARD = ExitGuard().install()
    code: int = 0
    try:
        app()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported below, then the bounded exit
        if not _GUARD.signalled:
            import traceback

            traceback.print_exc()
        code = 1
    if _GUARD.signalled and code not in (0, 76):
        code = EXIT_PREEMPTED  # whatever was running when the signal came, the documented code is 75
    # Prefect's "Stopping temporary server" at exit would stand after memfit's last line (the result or error).
    logging.getLogger("prefect").setLevel(logging.WARNING)
    _GUARD.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
