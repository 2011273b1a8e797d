#!/usr/bin/env bash
# The three-preemption chain N times in a row (tests/e2e/test_recovery_stress.py), optionally with the rest of the
# suite running beside it on the same cores: a race in draining, claiming or restarting shows up as a failed round.
#
#   bash bench/recovery_stress.sh 20            # 20 rounds alone
#   bash bench/recovery_stress.sh 20 --busy     # 20 rounds, the suite (less the e2e tier) looping beside them
#
# Prints one line per round and the totals; the logs of every machine stay under bench/out/recovery-stress/.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-20}
py=${PYTHON:-.venv/bin/python}
out=bench/out/recovery-stress
rm -rf "$out"; mkdir -p "$out"
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true
busy_pid=
if [ "${2:-}" = "--busy" ]; then
    ( while true; do "$py" -m pytest -q -p no:cacheprovider -m "not e2e" -x tests >>"$out/busy.log" 2>&1; done ) &
    busy_pid=$!
fi
start=$(date +%s)
MEMFIT_STRESS_ROUNDS=$rounds "$py" -m pytest -p no:cacheprovider -rA tests/e2e/test_recovery_stress.py \
    --basetemp="$out/tmp" 2>&1 | tee "$out/stress.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
status=${PIPESTATUS[0]}
[ -n "$busy_pid" ] && { pkill -P "$busy_pid" 2>/dev/null; kill "$busy_pid" 2>/dev/null; }
echo "rounds: $rounds, exit $status, $(( $(date +%s) - start )) s$([ -n "$busy_pid" ] && echo ', with the suite beside')"
exit "$status"
