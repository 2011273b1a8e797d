"""The `memfit` command line: run or resume the flow, probe, plan, list/verify training checkpoints, export, serve."""

from __future__ import annotations

from memfit.cli import checkpoints, planning, runs, serving
from memfit.cli.common import app, automations_app, checkpoints_app, gguf_converter_app, main

# Every command in one place, in the order `memfit --help` lists them; each module holds one seam's commands.
app.command()(runs.run)
app.command()(runs.probe)
app.command()(runs.profile)
app.command()(serving.serve)
app.command()(serving.status)
app.command("serve-model")(serving.serve_model)
app.command()(planning.estimate)
app.command()(planning.plan)
app.command("launch-node")(runs.launch_node)
app.command("config")(runs.show_config)
app.command()(checkpoints.resume)
app.command("export")(checkpoints.export_cmd)
app.add_typer(checkpoints_app, name="checkpoints")
checkpoints_app.command("ls")(checkpoints.checkpoints_ls)
checkpoints_app.command("verify")(checkpoints.checkpoints_verify)
app.add_typer(gguf_converter_app, name="gguf-converter")
gguf_converter_app.command("install")(checkpoints.gguf_converter_install)
app.add_typer(automations_app, name="automations")
automations_app.command("apply")(serving.automations_apply)

__all__ = ["app", "main"]
