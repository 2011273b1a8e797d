"""The long-running commands and the Prefect server's side: serve deployments, serve a model, automations, status."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from memfit.cli.common import PROCESS, ConfigArg, JsonOpt, SetOpt, environment, fail, load
from memfit.errors import MemfitError
from memfit.runtime.importing import collector_paused


def serve(config: ConfigArg = None, set_: SetOpt = None,
          limit: Annotated[int | None, typer.Option(help="Most flow runs executed at once by this process.")] = None
          ) -> None:
    """Register the finetune / retrain / export deployments with a Prefect server and run their flow runs."""
    environment()
    if not os.environ.get("PREFECT_API_URL"):
        typer.echo("error: memfit serve needs a Prefect server: start one (prefect server start --host 127.0.0.1) "
                   "and set PREFECT_API_URL=http://127.0.0.1:4200/api", err=True)
        raise typer.Exit(2)
    try:
        cfg = load(config, set_)
        with collector_paused(freeze=PROCESS.own):
            from flows.deploy import serve_deployments

        serve_deployments(cfg, limit=limit)
    except MemfitError as err:
        fail(err)


def automations_apply(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False,
                      dry_run: Annotated[bool, typer.Option("--dry-run", help="Print them; change nothing.")] = False
                      ) -> None:
    """Create or update memfit's recovery automations on the Prefect server (PREFECT_API_URL); idempotent."""
    environment()
    try:
        cfg = load(config, set_)
        from flows.recovery import apply_automations

        rows = apply_automations(cfg, dry_run=dry_run)
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps({"dry_run": dry_run, "automations": rows}))
        return
    for row in rows:
        typer.echo(f"{row.get('applied', 'would apply')}: {row['name']}"
                   + (f"\n  when {row['trigger']}\n  then {row['action']}" if "trigger" in row else ""))


def status(config: ConfigArg = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """A run's attempts (from Prefect), their causes, and how far its training checkpoints got."""
    environment()
    try:
        cfg = load(config, set_)
        from flows.recovery import format_status, run_status

        report = run_status(cfg)
    except MemfitError as err:
        fail(err)
    typer.echo(json.dumps(report) if as_json else format_status(report))


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
    environment()
    try:
        overrides = list(set_ or []) + [f"serve.{k}={v}" for k, v in (("host", host), ("port", port)) if v]
        cfg = load(config, overrides)
        with collector_paused(freeze=PROCESS.own):
            from memfit.server.run import serve as run_server

        run_server(cfg, model)
    except MemfitError as err:
        fail(err)
