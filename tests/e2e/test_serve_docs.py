"""docs/serving.md's 'Serve the champion' section runs as written: train, serve-model, curl, the openai client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port, process_group
from test_readme_commands import runnable

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PAGE = REPO / "docs" / "serving.md"


def test_serve_the_champion_section_runs_as_written(tmp_path, prefect_home_template):
    import re

    text = PAGE.read_text()
    m = re.search(r"^## Serve the champion\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/serving.md has no '## Serve the champion' section"
    blocks = runnable(re.findall(r"```bash\n(.*?)```", m.group(1), re.S))
    assert any("curl" in b for b in blocks) and any("from openai import OpenAI" in b for b in blocks)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    # Same commands, another port: nothing else on this machine may be listening on the default.
    script = "set -euo pipefail\n" + "\n".join(blocks).replace("8000", str(free_port()))
    shutil.copytree(prefect_home_template, tmp_path / "prefect-home")  # migrated once per session
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "PREFECT_HOME": str(tmp_path / "prefect-home")}
    for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    log = tmp_path / "serving.log"
    with process_group(["bash", "-c", script], env, tmp_path, log) as proc:
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the serving commands did not finish:\n{log.read_text()[-4000:]}")
    out = log.read_text()
    assert rc == 0, f"the serving commands failed ({rc}):\n{out[-4000:]}"
    assert '"object":"text_completion"' in out and '"model":"tiny/v1"' in out  # curl's completion
    assert "data: [DONE]" in out  # curl's stream
    assert re.search(r"^tiny/v1 '.+'$", out, re.M), out[-3000:]  # the openai client's lines
