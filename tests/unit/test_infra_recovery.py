"""Static checks of the recovery files that need no Prefect server: the SkyPilot managed job and the systemd unit."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit import config
from memfit.config import CheckpointConfig
from memfit.errors import ConfigError, MemoryLimitError, Preempted

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SKY_YAML = REPO / "infra" / "skypilot" / "memfit-finetune.yaml"
UNIT = REPO / "infra" / "systemd" / "memfit-run.service"
UNIT_ENV = REPO / "infra" / "systemd" / "memfit.env.example"

PREEMPTED, MISTAKE, MEMORY_LIMIT = Preempted.exit_code, ConfigError.exit_code, MemoryLimitError.exit_code
GRACE_S = CheckpointConfig().grace_seconds
AWS_SPOT_NOTICE_S = 120
SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY", re.I)

# skypilot 0.14.1 cannot be a dev dependency (it pins click<8.2 and uvicorn<0.36 against constraints.txt and
# uvicorn>=0.54), so these are the keys and types of its sky/utils/schemas.py that this YAML can touch.
# tests/integration/test_skypilot_loader.py runs SkyPilot's own loader from a separate venv.
SKY_TASK_KEYS = {"name", "workdir", "event_callback", "num_nodes", "resources", "file_mounts", "service", "pool",
                 "setup", "run", "envs", "secrets", "managed_secrets", "inputs", "outputs", "file_mounts_mapping",
                 "config", "volumes", "volume_mounts", "api_server_access"}
SKY_RESOURCE_KEYS = {"cloud", "region", "zone", "infra", "cpus", "memory", "accelerators", "instance_type",
                     "use_spot", "job_recovery", "volumes", "disk_size", "disk_tier", "local_disk", "network_tier",
                     "ports", "labels", "accelerator_args", "image_id", "autostop", "priority", "priority_class",
                     "max_hourly_cost", "ephemeral_storage", "any_of", "ordered"}
SKY_STRATEGIES = {"FAILOVER", "EAGER_NEXT_REGION"}  # the recovery strategies registered in 0.14.1
ENV_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# --------------------------------------------------------------------------- helpers


def _expand(text: str, env: dict[str, str]) -> str:
    """${VAR} and $VAR as the shell and systemd expand them here (every one must be defined)."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"${name} is not set anywhere"
        return env[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def _memfit_argv(command: str, env: dict[str, str]) -> list[str]:
    """The `memfit run ...` argv of a command (shell continuation lines joined), variables expanded."""
    joined = command.replace("\\\n", " ")
    line = next((ln for ln in joined.splitlines() if re.search(r"\bmemfit run\b", ln)), None)
    assert line, f"no `memfit run` in:\n{command}"
    argv = [_expand(word, env) for word in shlex.split(line)]
    if argv[0] == "exec":
        argv = argv[1:]
    assert Path(argv[0]).name == "memfit" and argv[1] == "run", argv
    return argv


def _overrides(argv: list[str]) -> dict[str, str]:
    sets = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
    return dict(item.split("=", 1) for item in sets)


def _loads_as_memfit_config(argv: list[str]) -> config.MemfitConfig:
    """What `memfit run` does first with these arguments: the config file plus the --set overrides."""
    overrides = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
    return config.load(REPO / argv[2], overrides)


# --------------------------------------------------------------------------- SkyPilot


@pytest.fixture(scope="module")
def task() -> dict[str, Any]:
    return yaml.safe_load(SKY_YAML.read_text())


def test_skypilot_yaml_schema(task: dict[str, Any]) -> None:
    """The parts of SkyPilot 0.14.1's task and resources schema this file uses: keys and types."""
    assert set(task) <= SKY_TASK_KEYS, f"not SkyPilot task keys: {set(task) - SKY_TASK_KEYS}"
    assert isinstance(task["name"], str) and isinstance(task["workdir"], str)
    assert isinstance(task["setup"], str) and isinstance(task["run"], str)
    for key, value in task["envs"].items():
        assert ENV_NAME.fullmatch(key) and (value is None or isinstance(value, str)), (key, value)

    res = task["resources"]
    assert set(res) <= SKY_RESOURCE_KEYS, f"not SkyPilot resources keys: {set(res) - SKY_RESOURCE_KEYS}"
    assert isinstance(res["accelerators"], str | dict) and isinstance(res["use_spot"], bool)
    rec = res["job_recovery"]
    assert set(rec) <= {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}, rec
    assert rec["strategy"] in SKY_STRATEGIES
    assert isinstance(rec["max_restarts_on_errors"], int) and not isinstance(rec["max_restarts_on_errors"], bool)
    assert rec["max_restarts_on_errors"] >= 0
    codes = rec["recover_on_exit_codes"]
    assert isinstance(codes, list) and len(set(codes)) == len(codes)
    assert all(isinstance(c, int) and 0 <= c <= 255 for c in codes), codes


def test_skypilot_recovers_only_a_preempted_run(task: dict[str, Any]) -> None:
    res = task["resources"]
    assert res["use_spot"] is True
    assert re.fullmatch(r"[\w-]+:\d+", res["accelerators"]), "a GPU, e.g. L4:1"
    rec = res["job_recovery"]
    assert PREEMPTED in rec["recover_on_exit_codes"]
    assert MISTAKE not in rec["recover_on_exit_codes"] and MEMORY_LIMIT not in rec["recover_on_exit_codes"]
    # SkyPilot 0.14.1 (jobs/recovery_strategy.py, should_restart_on_failure) restarts ANY non-zero exit while
    # fewer than max_restarts_on_errors restarts happened; only 0 keeps exit 2 and 76 from being rerun.
    assert rec["max_restarts_on_errors"] == 0


def test_skypilot_runs_memfit_against_s3(task: dict[str, Any]) -> None:
    env = {k: v for k, v in task["envs"].items() if v is not None}
    run = task["run"]
    assert re.search(r"^\s*exec \S*memfit run ", run, re.M), "exec: memfit's exit code must be the job's"
    argv = _memfit_argv(run, env)
    uri = _overrides(argv)["checkpoint.uri"]
    assert uri.startswith("s3://") and len(uri) > len("s3://"), uri
    cfg = _loads_as_memfit_config(argv)
    assert cfg.checkpoint.uri == uri and cfg.checkpoint.grace_seconds < AWS_SPOT_NOTICE_S

    # Setup installs memfit where run finds it, torch first, the rest under the project's pins.
    setup = task["setup"]
    assert argv[0] == ".venv/bin/memfit" and "uv venv --python 3.11" in setup and ".venv" in setup
    torch_at = setup.index("torch==")
    assert setup.index("-c constraints.txt .") > torch_at
    assert task["workdir"] == "."  # launched from the repository root: constraints.txt and configs/ are there


def test_skypilot_envs_hold_settings_not_secrets(task: dict[str, Any]) -> None:
    envs = task["envs"]
    # null = required at launch: a recovered job on a fresh machine must log to the same MLflow server
    assert "MLFLOW_TRACKING_URI" in envs and envs["MLFLOW_TRACKING_URI"] is None
    assert envs["MEMFIT_SPOT_WATCHER"] == "true"
    for key, value in envs.items():
        assert not (SECRET_NAME.search(key) and value), f"secret inline: {key}"
    assert not task.get("secrets"), "secrets go in at launch (--secret), not in the file"


# --------------------------------------------------------------------------- systemd


def _unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Section -> [(key, value)], keys repeated as systemd allows (configparser would keep only the last)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None and "=" in line, f"{path.name}: {raw!r}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _last(entries: list[tuple[str, str]], key: str, default: str | None = None) -> str | None:
    values = [v for k, v in entries if k == key]
    return values[-1] if values else default


def _codes(entries: list[tuple[str, str]], key: str) -> set[int]:
    return {int(word) for k, v in entries if k == key for word in v.split() if word.isdigit()}


def _restarts(service: list[tuple[str, str]], code: int) -> bool:
    """systemd's decision after the main process exits with `code` (systemd.service(5), Restart= table)."""
    if code in _codes(service, "RestartForceExitStatus"):  # "regardless of the restart setting"
        return True
    if code in _codes(service, "RestartPreventExitStatus"):
        return False
    clean = code == 0 or code in _codes(service, "SuccessExitStatus")
    restart = _last(service, "Restart", "no")
    return {"always": True, "on-success": clean, "on-failure": not clean}.get(restart, False)


def _unit_env(service: list[tuple[str, str]]) -> dict[str, str]:
    """Environment= first, then the EnvironmentFile (the example) on top, as systemd applies them."""
    env = dict(v.split("=", 1) for k, v in service if k == "Environment")
    for line in UNIT_ENV.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{UNIT_ENV.name}: not KEY=value: {line!r}"
            env[key.strip()] = value.strip()
    return env


@pytest.fixture(scope="module")
def unit() -> dict[str, list[tuple[str, str]]]:
    return _unit_entries(UNIT)


def test_unit_restarts_after_75_only_among_memfit_codes(unit: dict[str, list[tuple[str, str]]]) -> None:
    service = unit["Service"]
    assert _restarts(service, PREEMPTED), "exit 75: the rerun resumes from the checkpoint just committed"
    assert not _restarts(service, 0), "exit 0: the run is done"
    assert not _restarts(service, MISTAKE), "exit 2: a mistake in config or data fails the same way again"
    assert not _restarts(service, MEMORY_LIMIT), "exit 76: needs a leaner memory.policy first"
    assert _restarts(service, 1), "a crash: the rerun resumes from the newest checkpoint (bounded below)"
    assert not _codes(service, "RestartForceExitStatus") & _codes(service, "RestartPreventExitStatus")
    # a crash loop ends: bounded starts per interval
    assert int(_last(unit["Unit"], "StartLimitBurst")) >= 2 and int(_last(unit["Unit"], "StartLimitIntervalSec")) > 0


def test_unit_stops_within_the_grace(unit: dict[str, list[tuple[str, str]]]) -> None:
    service = unit["Service"]
    assert _last(service, "KillSignal") == "SIGTERM"
    # SIGTERM to memfit alone: it ends its Prefect server itself, after the save (docs/spot.md)
    assert _last(service, "KillMode") == "mixed"
    stop_s = int(_last(service, "TimeoutStopSec"))
    assert GRACE_S < stop_s <= AWS_SPOT_NOTICE_S, stop_s
    assert _last(service, "Type") == "exec"
    assert ("WantedBy", "multi-user.target") in unit["Install"]
    assert ("After", "network-online.target") in unit["Unit"] and ("Wants", "network-online.target") in unit["Unit"]


def test_unit_runs_memfit_with_settings_from_a_file(unit: dict[str, list[tuple[str, str]]]) -> None:
    service = unit["Service"]
    workdir = Path(_last(service, "WorkingDirectory"))
    assert workdir.is_absolute()
    assert _last(service, "EnvironmentFile") == "/etc/memfit/memfit.env"
    env = _unit_env(service)
    argv = _memfit_argv(_last(service, "ExecStart"), env)
    assert Path(argv[0]) == workdir / ".venv" / "bin" / "memfit"
    assert "${MEMFIT_CHECKPOINT_URI}" in _last(service, "ExecStart")
    assert _overrides(argv)["checkpoint.uri"].startswith("s3://")
    assert _loads_as_memfit_config(argv).checkpoint.uri == env["MEMFIT_CHECKPOINT_URI"]
    for key, value in (v.split("=", 1) for k, v in service if k == "Environment"):
        assert not SECRET_NAME.search(key), f"secret inline in the unit: {key}={value}"
    for key, value in env.items():
        assert not (SECRET_NAME.search(key) and value), f"{UNIT_ENV.name} ships a secret value: {key}"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd); the unit's semantics are "
                    "checked above by parsing it")
    # verify checks that ExecStart's program exists: point /opt/memfit at a stand-in checkout
    root = tmp_path / "memfit"
    (root / ".venv" / "bin").mkdir(parents=True)
    stub = root / ".venv" / "bin" / "memfit"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/memfit", str(root)))
    proc = subprocess.run([exe, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=20)
    # verify exits 0 on unknown keys and unparsable values; it only says so on stderr
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
