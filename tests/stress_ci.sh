#!/usr/bin/env bash
# Does the README's test command pass on a busy machine, every time? (issue 11 §1)
#
# Runs N consecutive fresh clones of the repository, each with the README's test command, while
# CPU-bound burner processes keep every core busy. Prints per-run wall time and PASS/FAIL, then
# "passed P of N"; exits 0 only when every run passed. The burners are killed on any exit.
#
#   tests/stress_ci.sh [N]                      N runs (default 10)
#
# Started in the background (`nohup tests/stress_ci.sh 10 &`), every process below it inherits
# SIGINT and SIGQUIT ignored (bash does that for a non-interactive background job); the suite
# must pass that way too, so the Ctrl-C test restores them in the command it starts, as a shell
# does for a foreground job.
#
# Environment (all optional):
#   STRESS_REPO      what to clone (default: this checkout; commit first: a clone sees HEAD only)
#   STRESS_CMD       the command run inside each clone (default: the README's test command, read
#                    from .ci/run); e.g. STRESS_CMD='python -m pytest -q tests/test_launch.py'
#   STRESS_BURNERS   CPU burners to run (default: the number of cores, `nproc`)
#   STRESS_VENV      1 (default): run each clone in its own virtual environment that sees the
#                    system's packages (so `pip install -e` does not repoint the machine's own
#                    zeroplan install at a clone that is deleted afterwards); 0: no venv
#   STRESS_LOG_DIR   where the log of a failed run is kept (default: /tmp)
set -u

N="${1:-10}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
REPO="${STRESS_REPO:-$HERE}"
BURNERS="${STRESS_BURNERS:-$(nproc)}"
USE_VENV="${STRESS_VENV:-1}"
LOG_DIR="${STRESS_LOG_DIR:-/tmp}"
if [ -z "${STRESS_CMD:-}" ]; then
  # the README's test command is the line of .ci/run that runs pytest (tests/test_readme.py keeps them equal)
  STRESS_CMD="$(grep -m1 'python -m pytest' "$HERE/.ci/run")"
fi
case "$N" in ''|*[!0-9]*) echo "stress_ci: N must be a whole number, got '$N'" >&2; exit 2 ;; esac

TMP="$(mktemp -d "${TMPDIR:-/tmp}/zeroplan-stress.XXXXXX")"
BURNER_PIDS=()
cleanup() {
  for p in "${BURNER_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${BURNER_PIDS[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq 1 "$BURNERS"); do
  python3 -c 'while True: pass' &
  BURNER_PIDS+=("$!")
done

echo "stress_ci: $N fresh-clone run(s) of: $STRESS_CMD"
echo "stress_ci: repo $REPO at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'), $BURNERS CPU burner(s) on $(nproc) core(s)"
passed=0
failed=0
for i in $(seq 1 "$N"); do
  run="$TMP/run$i"
  log="$TMP/run$i.log"
  start=$(date +%s.%N)
  (
    set -e
    unset PYTHONPATH  # the clone must test itself, not the checkout the script came from
    git clone -q "$REPO" "$run/z"
    cd "$run/z"
    if [ "$USE_VENV" = 1 ]; then
      # --without-pip: seconds instead of ~30 s (ensurepip) on a busy machine; `pip` is the system's
      # pip run by the venv's python, so it installs into the venv
      python3 -m venv --system-site-packages --without-pip "$run/venv"
      printf '#!/bin/sh\nexec "%s" -m pip "$@"\n' "$run/venv/bin/python" >"$run/venv/bin/pip"
      chmod +x "$run/venv/bin/pip"
      # shellcheck disable=SC1091
      . "$run/venv/bin/activate"
    fi
    bash -c "$STRESS_CMD"
  ) >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  wall=$(python3 -c "print(f'{$end - $start:.1f}')")
  if [ "$rc" = 0 ]; then
    passed=$((passed + 1))
    echo "run $i/$N: PASS in ${wall} s ($(grep -E '[0-9]+ passed' "$log" | tail -1))"
  else
    failed=$((failed + 1))
    keep="$LOG_DIR/zeroplan-stress-run$i-$$.log"
    cp "$log" "$keep"
    echo "run $i/$N: FAIL (rc $rc) in ${wall} s; log: $keep"
    grep -E '^(FAILED|ERROR) ' "$log" | head -5 | sed 's/^/    /'
  fi
  rm -rf "$run"
done
echo "stress_ci: passed $passed of $N"
[ "$failed" = 0 ]
