"""Commands on a run's training checkpoints: list and verify them, resume the run, export one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memfit.cli.common import PROCESS, JsonOpt, SetOpt, environment, fail
from memfit.cli.runs import run
from memfit.errors import ConfigError, MemfitError
from memfit.runtime.importing import collector_paused

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


def checkpoints_ls(uri: UriArg, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
                   region: RegionOpt = None) -> None:
    """List training checkpoints: complete ones (with a manifest) with step, size and time; incomplete ones apart."""
    environment()
    try:
        done, partial = _rows(_manager(uri, endpoint_url, region).scan())
    except MemfitError as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps({"uri": uri, "checkpoints": done, "incomplete": partial}))
        return
    _print(uri, done, partial)


def checkpoints_verify(uri: UriArg, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
                       region: RegionOpt = None) -> None:
    """Download every complete training checkpoint and check its sizes and sha256; exit 1 if one is corrupt."""
    import tempfile

    environment()
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
        fail(err)
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


def resume(uri: UriArg, set_: SetOpt = None, as_json: JsonOpt = False, endpoint_url: EndpointOpt = None,
           region: RegionOpt = None) -> None:
    """Continue the run whose training checkpoints are at URI, with the config saved in its newest one."""
    import tempfile

    import yaml

    environment()
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
        fail(err)
    # The stored config is data from the store, not from you: remote model code stays off unless --set says so.
    overrides = ["model.trust_remote_code=false", f"checkpoint.uri={uri}"]
    overrides += [f"checkpoint.{k}={v}" for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v]
    with tempfile.TemporaryDirectory(prefix="memfit-resume-") as tmp:
        path = Path(tmp) / "resumed.yaml"
        path.write_text(yaml.safe_dump(stored, sort_keys=False))
        typer.echo(f"resuming {uri} from step {complete[-1].step} with the config saved in {complete[-1].uri}",
                   err=True)
        run(config=path, set_=overrides + list(set_ or []), as_json=as_json)


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
                                                      "safetensors, onnx, adapter, gguf, gguf-adapter; SafeTensors "
                                                      "always. Given, it "
                                                      "replaces --onnx/--adapter.")] = None,
    quant: Annotated[list[str] | None, typer.Option("--quant", help="GGUF files to write (repeat it): f16, q8_0, "
                                                    "q4_k_m. Unset: the checkpoint's export.gguf_quants.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a training checkpoint to a verified SafeTensors folder and ONNX file (config from the checkpoint)."""
    environment()
    try:
        with collector_paused(freeze=PROCESS.own):
            from memfit.release.from_checkpoint import export_checkpoint

        if format_:
            unknown = sorted(set(format_) - {"safetensors", "onnx", "adapter", "gguf", "gguf-adapter"})
            if unknown:
                raise ConfigError(f"--format {', '.join(unknown)}: not a format (safetensors, onnx, adapter, gguf, "
                                  "gguf-adapter)")
            onnx, adapter = "onnx" in format_, "adapter" in format_
        report = export_checkpoint(checkpoint_uri, out, onnx=onnx, onnx_only=onnx_only, upload_uri=upload,
                                   overrides=set_, adapter=adapter, gguf="gguf" in (format_ or []), gguf_quants=quant,
                                   gguf_adapter="gguf-adapter" in (format_ or []))
    except MemfitError as err:
        fail(err)
    from memfit.release.from_checkpoint import export_lines

    lines = export_lines(report)
    for line in lines:  # with --json the human lines go to stderr: stdout is the JSON object alone
        typer.echo(line, err=as_json)
    if as_json:
        typer.echo(json.dumps(report, sort_keys=True, default=str))


def gguf_converter_install(
        sdist: Annotated[Path | None, typer.Option("--sdist", help="The llama-cpp-python sdist to take it from "
                                                   "(default: pip downloads the pinned one, from its cache if there).")]
        = None,
        dest: Annotated[Path | None, typer.Option("--dir", help="Where to put it (default: beside the packages, "
                                                  "where export.gguf_converter unset looks).")] = None) -> None:
    """Install llama.cpp's convert_hf_to_gguf.py (with conversion/ and gguf-py/) from the pinned llama-cpp-python
    sdist; prints where it went and llama.cpp's commit."""
    from memfit.release.gguf_converter import install

    try:
        conv = install(dest, sdist)
    except (MemfitError, OSError) as err:
        fail(err)
    typer.echo(f"llama.cpp's converter (llama-cpp-python {conv.llama_cpp_python}, llama.cpp "
               f"{conv.llama_cpp_commit[:12]}) installed in {conv.dir}")
