#!/bin/sh
# Run a given copy of Horovod's test/parallel/test_torch.py against mpitrain.torch.
#
#   tools/horovod_conformance.sh TEST_TORCH_PY COMMON_PY NP [TEST_NAME ...]
#
# TEST_TORCH_PY and COMMON_PY are Horovod's test/parallel/test_torch.py and
# test/utils/common.py (v0.28.1), fetched by whoever runs this; nothing is fetched here.
# Horovod's other torch test files run the same way (test/parallel/test_adasum_pytorch.py,
# test/single/test_torch_elastic.py, the latter at one rank): TEST_TORCH_PY is any of them.
# A scratch directory gets a `horovod` package whose `torch` is `mpitrain.torch`, and
# each test runs in its own launch of NP ranks with a limit of $LIMIT seconds (90).
# The Python that runs it ($PYTHON, default python3) needs pytest<8, mock, cloudpickle
# and parameterized; $MPIRUN (default mpirun) launches it. One line per test, then:
#   passed N failed N skipped N hung N
set -u
if [ $# -lt 3 ]; then
    echo "usage: $0 TEST_TORCH_PY COMMON_PY NP [TEST_NAME ...]" >&2
    exit 2
fi
spec=$1 common=$2 np=$3
shift 3
PYTHON=${PYTHON:-python3}
MPIRUN=${MPIRUN:-mpirun}
LIMIT=${LIMIT:-90}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/parallel" "$work/utils" "$work/horovod/torch" "$work/horovod/runner/util"
file=$(basename "$spec")
cp "$spec" "$work/parallel/$file"
cp "$common" "$work/utils/common.py"
touch "$work/horovod/__init__.py" "$work/horovod/runner/__init__.py" \
      "$work/horovod/runner/util/__init__.py"
# horovod.torch is mpitrain.torch itself, not a copy of its names (and its mpi_ops, which
# the Adasum file imports from, is mpitrain.torch's).
cat > "$work/horovod/torch/__init__.py" <<'PY'
import sys
import mpitrain.torch
import mpitrain.torch.mpi_ops
sys.modules[__name__] = mpitrain.torch
sys.modules[__name__ + ".mpi_ops"] = mpitrain.torch.mpi_ops
PY
# common.py imports this one helper from Horovod's launcher: a background thread.
cat > "$work/horovod/runner/util/threads.py" <<'PY'
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    def run(*a):
        try:
            target(*a)
        except Exception:
            if not silent:
                raise
    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
PY
# torch >= 2.13's Muon takes 2-D parameters only; the file's loops over every
# torch.optim optimizer (module name "torch.optim...") give it 1-D ones. Horovod itself
# fails there too, so Muon is left out of those loops, for both.
cat > "$work/parallel/conftest.py" <<'PY'
import torch.optim

if hasattr(torch.optim, "Muon"):
    torch.optim.Muon.__module__ = "left_out_of_the_optimizer_loops"
PY
export PYTHONPATH="$work:$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$work/parallel"
# the file's tests, as FILE::CLASS::NAME
ids=$("$PYTHON" -m pytest -p no:cacheprovider --collect-only -q "$file" \
      | sed -n 's/^\([A-Za-z0-9_]*\.py::[A-Za-z0-9_]*::[A-Za-z0-9_]*\).*/\1/p')
if [ $# -eq 0 ]; then
    set -- $(echo "$ids" | sed 's/.*:://')
fi
passed=0 failed=0 skipped=0 hung=0
for name in "$@"; do
    log="$work/$name.log"
    id=$(echo "$ids" | grep -m 1 "::$name\$")
    if [ -z "$id" ]; then
        echo "no test $name in $file" >"$log"
        rc=1
    else
        timeout -k 5 "$LIMIT" $MPIRUN -np "$np" "$PYTHON" -m pytest -p no:cacheprovider -q -rs \
            "$id" >"$log" 2>&1
        rc=$?
    fi
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        result=hung
    elif [ $rc -ne 0 ]; then
        result=failed
    elif grep -q " skipped" "$log" && ! grep -q " passed" "$log"; then
        result=skipped
    else
        result=passed
    fi
    eval "$result=\$((\$$result + 1))"
    echo "$result $name"
    if [ "$result" = failed ] || [ "$result" = hung ]; then
        if [ -n "${KEEP_LOGS:-}" ]; then cp "$log" "$KEEP_LOGS/"; fi
    fi
done
echo "passed $passed failed $failed skipped $skipped hung $hung"
[ $failed -eq 0 ] && [ $hung -eq 0 ]
