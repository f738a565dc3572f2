#!/usr/bin/env bash
# tools/stress.sh PYTHON RUNS PYTEST_ARGS...: run the tests RUNS times in a row under a CPU hog.
# The hog is stress-ng --cpu 2 (Debian's stress-ng) or, where it is absent, two busy Python processes;
# it stops with this script. Exits 1 at the first run with a failure, after printing that run's summary.
set -uo pipefail
python=$1 runs=$2
shift 2
hog=()
if command -v stress-ng >/dev/null; then
    stress-ng --cpu 2 --quiet &
    hog+=($!)
else
    for _ in 1 2; do "$python" -c "while True: pass" & hog+=($!); done
fi
trap 'kill "${hog[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
echo "stress: ${runs} runs of pytest $* under a CPU hog ($(command -v stress-ng >/dev/null && echo 'stress-ng --cpu 2' || echo 'two busy processes'))"
for run in $(seq "$runs"); do
    start=$SECONDS
    out=$("$python" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" "$@" 2>&1)
    rc=$?
    summary=$(printf '%s\n' "$out" | tail -1)
    echo "stress: run ${run}/${runs}: ${summary} ($((SECONDS - start)) s)"
    if [ "$rc" -ne 0 ]; then
        printf '%s\n' "$out" | grep -E "^(FAILED|ERROR)" | head -20
        exit 1
    fi
done
echo "stress: ${runs} runs, 0 failures"
