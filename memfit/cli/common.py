"""The `memfit` app, the options its commands share, and the process around a command (environment, errors, exit)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from memfit.errors import MemfitError
from memfit.runtime.importing import collector_paused

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune language models on the GPU you have; keep runs alive on spot machines.")
checkpoints_app = typer.Typer(no_args_is_help=True, help="Training checkpoints (saved state to resume from).")
gguf_converter_app = typer.Typer(no_args_is_help=True, help="llama.cpp's own convert_hf_to_gguf.py, which writes "
                                 "the GGUF export (pinned with llama-cpp-python).")
automations_app = typer.Typer(no_args_is_help=True, help="Prefect automations that restart preempted or vanished "
                              "runs (recovery section).")

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config (a diff from defaults), e.g. configs/tiny.yaml.")]
SetOpt = Annotated[list[str] | None,
                   typer.Option("--set", help="Override a field: --set train.max_steps=10 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object, last, on stdout.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show Prefect's tracebacks on the terminal too.")]


class _Process:
    """What main() sets in a real `memfit` process; in-process callers (tests, CliRunner) keep the defaults."""

    guard: Any = None  # the ExitGuard: a stop signal ends the run within the grace period
    own: bool = False  # True in a real `memfit` process: its start-up imports may be frozen out of the GC


PROCESS = _Process()


def environment() -> None:
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


def fail(err: BaseException, hint: str = "") -> NoReturn:
    """Bad input or a stop a user can act on: one line on stderr, the error's exit code (2 unless it says)."""
    code = getattr(err, "exit_code", 2)
    typer.echo(f"error: {err}{hint}", err=True)
    raise typer.Exit(code)


def load(config: Path | None, overrides: list[str] | None) -> Any:
    from memfit import config as cfgmod

    return cfgmod.load(config, overrides or [])


def phase(config: Path | None, overrides: list[str] | None, name: str) -> tuple[Any, Any]:
    """The resolved config and `memfit.phases.<name>(config)` (imported only now: torch comes with it);
    bad input is one line and exit 2."""
    environment()
    try:
        cfg = load(config, overrides)
        with collector_paused(freeze=PROCESS.own):
            from memfit import phases

        return cfg, getattr(phases, name)(cfg)
    except MemfitError as err:
        fail(err)


def main() -> None:
    """The `memfit` process: a stop signal ends it within the grace period, and nothing at exit can hang it."""
    from memfit.runtime.termination import EXIT_PREEMPTED, ExitGuard

    PROCESS.own = True

    if sys.argv[1:2] not in (["run"], ["resume"]):
        app()  # the other commands start no flow: Python's own signal handling is right for them
        return
    guard = PROCESS.guard = ExitGuard().install()
    code: int = 0
    try:
        app()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported below, then the bounded exit
        if not guard.signalled:
            import traceback

            traceback.print_exc()
        code = 1
    if guard.signalled and code not in (0, 76):
        code = EXIT_PREEMPTED  # whatever was running when the signal came, the documented code is 75
    # Prefect's "Stopping temporary server" at exit would stand after memfit's last line (the result or error).
    logging.getLogger("prefect").setLevel(logging.WARNING)
    guard.exit(code)
