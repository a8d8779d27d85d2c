#!/bin/sh
# The GPU checks of mpitrain in one command, for a machine with an NVIDIA GPU:
#   sh benchmarks/gpu_check.sh
# 1. the kernel tests (nvcc/NVRTC compile, every kernel against numpy on the GPU);
# 2. the MPI suite's GPU tests and the device-path tests at 1..$NP ranks;
# 3. the device-buffer allreduce benchmark, 1 MiB .. 1 GiB, mpitrain's ring against MPI's
#    own allreduce of the same job, with the device-to-device copy bandwidth of each size,
#    staged through pinned host memory, and CUDA-aware too when this MPI library is;
# 4. reduce_scatter, allgather and broadcast on device buffers, 1 MiB .. 256 MiB.
# Tables, JSON and plots go to $OUT; paste the tables, the device line and the commands
# into BENCHMARKS.md. Ranks share the node's GPUs (rank i uses GPU local_rank % count).
#
# Settings (environment): PY (python with mpitrain's requirements, CuPy, pytest-mpi),
# MPIRUN, NP (ranks, default 2), OUT (default bench-results/gpu), ITERS (default 20).
set -eu
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -z "${MPIRUN:-}" ]; then
  if [ -x .venv/bin/mpirun ]; then MPIRUN=.venv/bin/mpirun; else MPIRUN=mpirun; fi
fi
NP=${NP:-2}
OUT=${OUT:-bench-results/gpu}
ITERS=${ITERS:-20}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RUN="timeout 3600 $MPIRUN -x PYTHONPATH --oversubscribe --bind-to none"
PYTEST="$PY -m pytest -p no:cacheprovider --color=no -q -rfEs"
mkdir -p "$OUT"

echo "== device and policy"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
$PY -c "
import cupy, mpitrain as mt
from mpitrain.backends.cuda_aware import detected
print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(),
      'devices', cupy.cuda.runtime.getDeviceCount())
print('CUDA-aware MPI:', detected())
" || { echo "CuPy with a CUDA device is needed (set PY to a python that has it)"; exit 1; }

echo "== kernels"
$PYTEST tests/unit/test_kernels_compile.py tests/unit/test_gpu_kernels.py

n=1
while [ "$n" -le "$NP" ]; do
  echo "== GPU collectives at $n ranks"
  $RUN -np "$n" sh tests/mpi_rank.sh $PYTEST --with-mpi tests/mpi/test_gpu.py \
    tests/mpi/test_device_path.py
  n=$((n + 1))
done

# bench NAME COMMAND...: run a benchmark, keep its output in $OUT/NAME.txt, show it.
status=0
bench() {
  name=$1
  shift
  if "$@" >"$OUT/$name.txt"; then cat "$OUT/$name.txt"; else
    cat "$OUT/$name.txt"
    echo "FAILED: $*"
    status=1
  fi
}

aware=$($PY -c "from mpitrain.backends.cuda_aware import detected; print(int(bool(detected().aware)))")
policies=0
if [ "$aware" = 1 ]; then policies="0 1"; fi
for cuda_aware in $policies; do
  if [ "$cuda_aware" = 1 ]; then policy=cuda-aware; else policy=staged; fi
  export MPITRAIN_CUDA_AWARE=$cuda_aware
  echo "== allreduce busbw on device buffers, $policy, $NP ranks"
  bench "allreduce-$policy" $RUN -np "$NP" -x MPITRAIN_CUDA_AWARE $PY -m benchmarks allreduce \
    -b 1M -e 1G -f 2 -n "$ITERS" -w 5 --array cupy --impl mpitrain,mpi --algorithm auto,ring \
    --json "$OUT/allreduce-$policy.json" --plot "$OUT/allreduce-$policy.png"
  for collective in reduce_scatter allgather broadcast; do
    echo "== $collective on device buffers, $policy, $NP ranks"
    bench "$collective-$policy" $RUN -np "$NP" -x MPITRAIN_CUDA_AWARE $PY -m benchmarks \
      "$collective" -b 1M -e 256M -f 4 -n "$ITERS" -w 5 --array cupy --impl mpitrain,mpi \
      --json "$OUT/$collective-$policy.json"
  done
done
echo "== done: results in $OUT"
exit $status
