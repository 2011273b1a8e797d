"""Where a model comes from: a local Hugging Face folder or a hub id, checked without importing torch."""

from __future__ import annotations

import re
from pathlib import Path

from memfit.errors import ModelLoadError

# A hub id is "name" or "org/name"; anything else that does not exist locally is a missing folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def resolve_model_source(name_or_path: str, need_config: bool) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it a local folder); raises for missing or odd local paths."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model.name_or_path: {path} is a file; point it at a model folder "
                                 "(the output of save_pretrained) or a hub id")
        if need_config and not (path / "config.json").is_file():
            raise ModelLoadError(f"model.name_or_path: folder {path} has no config.json; point it at a "
                                 "Hugging Face model folder (the output of save_pretrained)")
        return str(path), True
    looks_local = name_or_path.startswith(("/", "./", "../", "~", ".\\")) or not _HUB_ID.match(name_or_path)
    if looks_local:
        full = str(path.absolute())
        shown = name_or_path if full == name_or_path else f"{name_or_path} ({full})"
        raise ModelLoadError(f"model.name_or_path: folder {shown} not found; check the path, or give a "
                             "hub id like 'org/name'")
    return name_or_path, False
