#!/usr/bin/env bash
# The no-flaky-test check (make flaky): the whole suite 3 times in random order (pytest-randomly, off in make test,
# is switched on here: `-p randomly` after pyproject's `-p no:randomly` unblocks it; each run's seed differs and is
# printed), then the timing-prone files 20 times each, also in random order, a busy process on every core meanwhile
# (stopped at the end whatever happens). Prints each run's seed and summary line; exits 1 if any run failed. Long:
# run it on a machine nobody else is using.
#   scripts/flaky.sh [PYTHON] [RUNS] [REPEATS]     (FLAKY_SUITE, FLAKY_FILES: other tests, for a smoke test;
#   FLAKY_HOGS: how many busy processes (default: one per core; 0 where other work, e.g. a mutation run at the same
#   nice level, keeps every core busy: each summary line ends with the load average, which shows it)
set -u
PY=${1:-.venv/bin/python}
RUNS=${2:-3}
REPEATS=${3:-20}
# -v cancels the -q of pyproject's addopts: at verbosity 0 pytest prints its header, where pytest-randomly names
# the seed ("Using --randomly-seed=N"; rerun a failure with that flag), and no line per test
SUITE=${FLAKY_SUITE:-}  # what the random-order runs run (default: the whole suite)
TIMING_PRONE=${FLAKY_FILES:-"tests/test_serve*.py tests/test_shards.py tests/test_faults.py tests/test_distributed.py"}
failed=0
hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done; hogs=(); }
trap stop_hogs EXIT
trap 'echo "flaky: interrupted"; exit 130' INT TERM  # stops here (the EXIT trap then stops the hogs)

summary() {  # the seed line and the last summary line of a pytest log
    grep -m1 -o 'Using --randomly-seed=[0-9]*' "$1" || true
    grep -E '(passed|failed|error|skipped|no tests ran)' "$1" | tail -1 | tr -d '='
    echo "(load average $(cut -d' ' -f1-3 /proc/loadavg))"
}

HOGS=${FLAKY_HOGS:-$(nproc)}
for _ in $(seq "$HOGS"); do (while :; do :; done) & hogs+=($!); done
echo "flaky: $HOGS busy processes started beside the suite ($(nproc) cores)"
for i in $(seq "$RUNS"); do
    log=$(mktemp)
    "$PY" -m pytest -p randomly -p no:cacheprovider -v $SUITE >"$log" 2>&1; rc=$?
    echo "flaky: suite run $i/$RUNS (random order, rc $rc): $(summary "$log" | paste -sd ' ')"
    [ "$rc" = 0 ] || { failed=1; tail -40 "$log"; }
    rm -f "$log"
done
for file in $TIMING_PRONE; do
    for i in $(seq "$REPEATS"); do
        log=$(mktemp)
        "$PY" -m pytest -p randomly -p no:cacheprovider -v "$file" >"$log" 2>&1; rc=$?
        echo "flaky: $file $i/$REPEATS (rc $rc): $(summary "$log" | paste -sd ' ')"
        [ "$rc" = 0 ] || { failed=1; tail -40 "$log"; }
        rm -f "$log"
    done
done
[ "$failed" = 0 ] && echo "flaky: every run passed" || echo "flaky: FAILED: a run above failed"
exit "$failed"
