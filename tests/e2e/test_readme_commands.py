"""The README's operating sections run as written (blocks marked `# needs ...` excepted: Docker, a cloud)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port, process_group

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SECTIONS = ["Run from the Prefect UI", "Schedule retraining", "Review in MLflow", "Deploy on spot instances",
            "Several GPUs and machines"]


def section_blocks(readme: str, title: str) -> list[str]:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return re.findall(r"```bash\n(.*?)```", m.group(1), re.S)


def runnable(blocks: list[str]) -> list[str]:
    return [b for b in blocks if not b.lstrip().startswith("# needs")]


@pytest.mark.parametrize("title", SECTIONS)
def test_section_exists_with_commands(title):
    blocks = section_blocks((REPO / "README.md").read_text(), title)
    assert blocks, f"'{title}' shows no commands"


@pytest.mark.parametrize("title", SECTIONS)
def test_section_commands_run(title, tmp_path, prefect_home_template):
    blocks = runnable(section_blocks((REPO / "README.md").read_text(), title))
    if not blocks:
        pytest.skip(f"every block of '{title}' needs Docker or a cloud account")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "infra").symlink_to(REPO / "infra")
    script = "set -euo pipefail\n" + "\n".join(blocks)
    # Same commands, other ports: nothing else on this machine may be listening on the defaults.
    script = script.replace("4200", str(free_port())).replace("5000", str(free_port()))
    shutil.copytree(prefect_home_template, tmp_path / "prefect-home")  # migrated once per session
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PYTHONUNBUFFERED": "1"}
    for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    log = tmp_path / "readme.log"
    with process_group(["bash", "-c", script], env, tmp_path, log) as proc:
        try:
            rc = proc.wait(timeout=480)
        except subprocess.TimeoutExpired:
            pytest.fail(f"'{title}' commands did not finish:\n{log.read_text()[-4000:]}")
    assert rc == 0, f"'{title}' failed ({rc}):\n{log.read_text()[-4000:]}"
