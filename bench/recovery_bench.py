"""Unattended recovery, measured: kill a run's machine at a random moment, time it back to its first resumed step.

Each trial: a fresh run on machine A (`memfit serve`), SIGKILL of A's whole process tree a random time after a
random training checkpoint (no notice: the machine vanishes), machine B started at once; nothing else is done.
`--notices` more trials send a spot notice (SIGTERM) instead. Recorded from Prefect (state times) and MLflow
(metric timestamps): kill → the first attempt's final state (Crashed by the silence window, or Preempted), → the
restarted flow run's start, → its first resumed training step; the steps lost against checkpoint.every_steps.

    python bench/recovery_bench.py --kills 5 --notices 2   # table on stdout, JSON and a chart beside --out
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import recovery_support as rs  # noqa: E402 - the tests' machines: the bench measures what they check
from servers import mlflow_server, prefect_server  # noqa: E402

EVERY = 20


def trial(i: int, cluster: dict, rng: random.Random, kind: str = "vanish") -> dict:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    run, s3, bucket = f"bench-{i}", cluster["s3"], cluster["bucket"]
    sets = rs.overrides(run, f"s3://{bucket}/{run}", cluster["tracking"], "train.max_steps=200")
    a = rs.Machine(cluster["root"], f"a{i}", cluster["env"]).start([str(rs.BIN / "memfit"), "serve", rs.TINY, *sets])
    b = rs.Machine(cluster["root"], f"b{i}", cluster["env"])
    ctx = lambda: a.tail() + b.tail()  # noqa: E731
    target, delay = rng.randint(1, 4), rng.uniform(0.0, 3.0)
    try:
        with get_client(sync_client=True) as client:
            dep = rs.wait_until("deployment", lambda: _deployment(client, run), 120, ctx)
            first = client.create_flow_run_from_deployment(dep.id)
            # The target-th training checkpoint by its step (older ones are pruned: checkpoint.keep_last).
            rs.wait_until("checkpoint", lambda: (rs.complete_checkpoints(s3, bucket, run) or [0])[-1] >= target * EVERY,
                          400, ctx, 0.1)
            time.sleep(delay)
            killed = time.time()
            if kind == "vanish":
                a.vanish()
            else:
                a.preempt()  # returns once the machine's processes have saved and ended
            b.start([str(rs.BIN / "memfit"), "serve", rs.TINY, *sets])
            crashed = rs.wait_until("first attempt ended", lambda: (s := client.read_flow_run(first.id).state)
                                    .is_final() and s, 200, ctx)
            # Every trial re-registers the same deployment: its runs are told apart by the config's run name.
            second = rs.wait_until("restarted", lambda: next((r for r in rs.flow_runs(client, deployment_id=dep.id)
                                                               if r.id != first.id and r.start_time
                                                               and _run_name(r) == run), None), 300, ctx)
            done = rs.wait_until("finished", lambda: (r := client.read_flow_run(second.id)).state.is_final() and r,
                                 400, ctx, 2)
    finally:
        a.stop()
        b.stop()
    mlf = MlflowClient(cluster["tracking"])
    exp = mlf.get_experiment_by_name("recovery-e2e")
    mrun = mlf.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run}'")[0]
    resumed = int(mrun.data.metrics["recovery/resumed_from_step"])
    # The stable key keeps one MLflow run across attempts: a step the first attempt logged before the kill (and lost)
    # is in the history too, so only a step logged after the kill is the restart's.
    first_step = min(m.timestamp for m in mlf.get_metric_history(mrun.info.run_id, "loss")
                     if m.step == resumed + 1 and m.timestamp / 1000 > killed)
    lost = int(mrun.data.metrics["recovery/steps_lost"])
    return {"trial": i, "kind": kind, "ended_as": crashed.name, "completed": done.state.is_completed(),
            "checkpoint_target": target * EVERY, "lost_per_every": round(lost / EVERY, 2),
            "kill_delay_s": round(delay, 2), "resumed_from": resumed,
            "steps_lost_recorded": lost,
            "detect_s": round(crashed.timestamp.timestamp() - killed, 1),
            "restart_start_s": round(second.start_time.timestamp() - killed, 1),
            "first_resumed_step_s": round(first_step / 1000 - killed, 1)}


def _run_name(flow_run) -> str:
    return flow_run.parameters.get("config", {}).get("run", {}).get("name", "")


def _deployment(client, run: str):
    """The deployment once this trial's machine registered it with this trial's config."""
    try:
        dep = client.read_deployment_by_name("memfit-finetune/finetune")
    except Exception:  # noqa: BLE001 - not registered yet
        return None
    return dep if dep.parameters["config"]["run"]["name"] == run else None


def table(rows: list[dict]) -> str:
    """One row a trial, then the median of each kind."""
    keys = ["trial", "kind", "ended_as", "completed", "resumed_from", "steps_lost_recorded", "lost_per_every",
            "detect_s", "restart_start_s", "first_resumed_step_s"]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        med = {k: statistics.median(r[k] for r in mine) for k in keys[5:]}
        out.append(f"| median of {len(mine)} | {kind} | | | | " + " | ".join(f"{med[k]:g}" for k in keys[5:]) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="trials whose machine vanishes (SIGKILL, no notice)")
    ap.add_argument("--notices", type=int, default=2, help="trials whose machine gets a spot notice (SIGTERM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "recovery_bench.json")
    args = ap.parse_args()
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a stuck trial waits
    rng = random.Random(args.seed)
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise
    from prefect.settings import PREFECT_API_URL, temporary_settings

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    rows = []
    try:
        root = Path(tempfile.mkdtemp(prefix="memfit-recovery-bench-"))  # kept when a trial fails: its logs
        (root / "mlflow").mkdir()
        s3 = rs.ks.s3_client(endpoint)
        bucket = f"recovery-bench-{int(time.time())}"
        s3.create_bucket(Bucket=bucket)
        print(f"S3 {endpoint} bucket {bucket}; work folder {root}", flush=True)
        with prefect_server(root, rs.BIN) as api, \
                mlflow_server(root / "mlflow", rs.ks.cli_env(endpoint, root)) as tracking, \
                temporary_settings(updates={PREFECT_API_URL: api}):
            cluster = {"root": root, "s3": s3, "bucket": bucket, "tracking": tracking,
                       "env": rs.machine_env(endpoint, api)}
            kinds = ["vanish"] * args.kills + ["notice"] * args.notices
            for i, kind in enumerate(kinds):
                try:
                    rows.append(trial(i, cluster, rng, kind))
                except (AssertionError, KeyError, ValueError) as err:  # one failed trial, said in the table
                    rows.append({"trial": i, "kind": kind, "failed": str(err).splitlines()[0][:200]})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        moto.stop()
    if any("failed" in r for r in rows):
        print(f"failed trials: their machines' logs are under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    rows_ok = [r for r in rows if "failed" not in r]
    print(table(rows_ok))
    for r in rows:
        if "failed" in r:
            print(f"trial {r['trial']} ({r['kind']}) failed: {r['failed']}")
    args.out.write_text(json.dumps({"every_steps": EVERY, "silent_after_seconds": 50, "heartbeat_seconds": 30,
                                    "backoff_seconds": 1, "trials": rows}, indent=1) + "\n")
    plot(rows_ok, args.out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for r in rows:
        y = r["trial"]
        ax.barh(y, r["detect_s"], color="#d62728", label="kill → first attempt ended" if y == 0 else None)
        ax.barh(y, r["restart_start_s"] - r["detect_s"], left=r["detect_s"], color="#ff7f0e",
                label="→ restarted run starts" if y == 0 else None)
        ax.barh(y, r["first_resumed_step_s"] - r["restart_start_s"], left=r["restart_start_s"], color="#2ca02c",
                label="→ first resumed step" if y == 0 else None)
    ax.set_xlabel("seconds after the machine vanished")
    ax.set_yticks([r["trial"] for r in rows], [f"{r['trial']} {r['kind']}" for r in rows])
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
