# Sourced by mpitrain's GPU scripts (gpu_check.sh, gpu_links.sh, gpu_torch.sh), from the
# checkout's root, once OUT is set (PY and MPIRUN default to python3 and mpirun): their
# environment, and one way to run a step with a time limit and a deadline for the whole
# script.
#
# It sets MPI (mpirun with the checkout on PYTHONPATH, ranks unbound), MPI_TESTS (the same
# for pytest jobs: every case at every rank count, see tests/conftest.py), PYTEST (pytest,
# quiet, with the reasons of skips and failures), lets Open MPI run as root, makes $OUT,
# and writes the device line (nvidia-smi) to $OUT/device.txt and the terminal.
#
#   step NAME COMMAND...
# runs COMMAND with its output in $OUT/NAME.log (its last $TAIL lines, default 40, shown
# after it), limited to $STEP_S seconds and to what is left of the script's $DEADLINE
# seconds (0: no deadline), counted from when this file was sourced. A step that would
# start with less than 20 s left is skipped and reported. A failure, a hang (killed at its
# limit) or a skip sets status=1; the next step runs. With $STEPS set (shell patterns of
# step names, e.g. STEPS="torch-tests-np2 train-* profile-*"), only the steps it names
# run; the others are reported as not selected, which is no failure.
PY=${PY:-python3}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MPI="$MPIRUN -x PYTHONPATH --oversubscribe --bind-to none"
MPI_TESTS="$MPI -x MPITRAIN_TEST_EVERY_CASE=1"
PYTEST="$PY -m pytest -p no:cacheprovider --color=no -q -rfEs"
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv |
  tee "$OUT/device.txt"
GPU_STEPS_BEGUN=$(date +%s)
STEP_S=${STEP_S:-900}
DEADLINE=${DEADLINE:-0}
TAIL=${TAIL:-40}
STEPS=${STEPS:-}
status=0

selected() {
  [ -z "$STEPS" ] && return 0
  set -f  # the patterns are matched against step names, not file names
  for pattern in $STEPS; do
    # shellcheck disable=SC2254
    case "$1" in $pattern) set +f; return 0 ;; esac
  done
  set +f
  return 1
}

step() {
  name=$1
  shift
  if ! selected "$name"; then
    echo "== $name: not selected (STEPS=$STEPS)"
    return
  fi
  start=$(date +%s)
  limit=$STEP_S
  if [ "$DEADLINE" -gt 0 ]; then
    left=$((DEADLINE - (start - GPU_STEPS_BEGUN)))
    if [ "$left" -lt 20 ]; then
      echo "== $name: SKIPPED (the script's $DEADLINE s are spent)"
      status=1
      return
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
  fi
  echo "== $name (limit $limit s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n "$TAIL" "$OUT/$name.log"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "-- $name: HUNG, killed after $limit s: $*"
    status=1
  elif [ "$rc" != 0 ]; then
    echo "-- $name: FAILED (rc=$rc) in $(( $(date +%s) - start )) s: $*"
    status=1
  else
    echo "-- $name: passed in $(( $(date +%s) - start )) s"
  fi
}
