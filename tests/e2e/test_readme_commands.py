"""The operating sections run as written (blocks marked `# needs ...` excepted: Docker, a cloud).

The README links each section into the docs page that holds it (`[title](docs/page.md#anchor)`); the test
follows that link and runs the page's section, so a section moved without its link fails here.
"""

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
            "Recover without a person", "Several GPUs and machines"]


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def section_source(title: str) -> tuple[str, str]:
    """(page, markdown) holding '## title': the README itself, or the docs page the README links it to."""
    readme = (REPO / "README.md").read_text()
    if re.search(rf"^## {re.escape(title)}$", readme, re.M):
        return "README.md", readme
    links = re.findall(rf"\]\((docs/[\w.-]+\.md)#{re.escape(anchor(title))}\)", readme)
    assert links, f"README.md has no '## {title}' section and no link to one (docs/PAGE.md#{anchor(title)})"
    page = links[0]
    assert (REPO / page).is_file(), f"README.md links '{title}' to {page}, which does not exist"
    return page, (REPO / page).read_text()


def section_blocks(title: str) -> list[str]:
    page, text = section_source(title)
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{page} has no '## {title}' section (the README links it there)"
    return re.findall(r"```bash\n(.*?)```", m.group(1), re.S)


def runnable(blocks: list[str]) -> list[str]:
    return [b for b in blocks if not b.lstrip().startswith("# needs")]


@pytest.mark.parametrize("title", SECTIONS)
def test_section_exists_with_commands(title):
    blocks = section_blocks(title)
    assert blocks, f"'{title}' shows no commands"


@pytest.mark.parametrize("title", SECTIONS)
def test_section_commands_run(title, tmp_path, prefect_home_template):
    blocks = runnable(section_blocks(title))
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
