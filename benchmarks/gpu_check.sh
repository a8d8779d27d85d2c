#!/bin/sh
# The GPU checks of mpitrain in one command, for a machine with an NVIDIA GPU:
#   sh benchmarks/gpu_check.sh            (make gpu-check NP=4)
# 1. the kernel tests (nvcc/NVRTC compile, every kernel against numpy on the GPU);
# 2. the GPU test modules at 1..$NP ranks (tests/mpi/test_gpu.py on CuPy arrays,
#    tests/mpi/test_torch_cuda.py on torch CUDA tensors, tests/mpi/
#    test_torch_distributed_cuda.py: DDP, FSDP2 and the collectives of torch.distributed
#    over the "mpitrain" backend on CUDA tensors; their fake-GPU cases run in
#    make test everywhere): each rank count in its own job, a collective that waits 120 s
#    raises StallError, a test that runs 300 s fails, a job that runs $JOB_S s is killed
#    and reported as hung;
# 3. training on CUDA: python -m benchmarks train --device cuda at $NP ranks, mpitrain.torch
#    against one GPU, its parameters checked against a one-process reference;
# 4. unless BENCH=0: the device-buffer benchmarks, mpitrain against MPI's own collective
#    of the same job, staged through pinned host memory (and CUDA-aware when this MPI
#    library is), allreduce 1 MiB .. 1 GiB, the others 1 MiB .. 256 MiB.
# Tables, JSON and logs go to $OUT; paste the tables, the device line and the commands
# into BENCHMARKS.md. Ranks share the node's GPUs (rank i uses GPU local_rank % count).
# The exit status is 1 if any step failed, hung or was skipped.
#
# Settings (environment): PY (python with mpitrain's requirements, CuPy, pytest-mpi,
# pytest-timeout), MPIRUN, NP (ranks, default 4: the ring forwards segments from 3 ranks
# on), OUT (default bench-results/gpu), ITERS (default 20), BENCH (1), JOB_S (900: each
# step's limit), DEADLINE (seconds for the whole script, default 0: none; a step that
# would start with less than 20 s of it left is skipped).
set -u
cd "$(dirname "$0")/.."
# PY and MPIRUN: as set, else the checkout's .venv, else the PATH's (make passes its own
# .venv paths, which a GPU machine that runs the checkout from source does not have)
if [ -z "${PY:-}" ] || ! "$PY" -c "" 2>/dev/null; then
  if .venv/bin/python -c "" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -z "${MPIRUN:-}" ] || ! "$MPIRUN" --version >/dev/null 2>&1; then
  if .venv/bin/mpirun --version >/dev/null 2>&1; then MPIRUN=.venv/bin/mpirun; else
    MPIRUN=mpirun; fi
fi
NP=${NP:-4}
OUT=${OUT:-bench-results/gpu}
ITERS=${ITERS:-20}
BENCH=${BENCH:-1}
JOB_S=${JOB_S:-900}
STEP_S=$JOB_S TAIL=100000
echo "== device and policy"
. benchmarks/gpu_steps.sh
$PY -c "
import cupy, mpitrain as mt
from mpitrain.backends.cuda_aware import detected
print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(),
      'devices', cupy.cuda.runtime.getDeviceCount())
print('CUDA-aware MPI:', detected())
" || { echo "CuPy with a CUDA device is needed (set PY to a python that has it)"; exit 1; }

step kernels $PYTEST tests/unit/test_kernels_compile.py tests/unit/test_gpu_kernels.py

n=1
while [ "$n" -le "$NP" ]; do
  step "gpu-tests-np$n" $MPI_TESTS -np "$n" -x MPITRAIN_STALL_TIMEOUT_S=120 sh tests/mpi_rank.sh \
    $PYTEST --timeout=300 --with-mpi -k "not fake" tests/mpi/test_gpu.py \
    tests/mpi/test_torch_cuda.py tests/mpi/test_torch_distributed_cuda.py
  n=$((n + 1))
done

step "train-cuda-np$NP" $MPI -np "$NP" $PY -m benchmarks train --device cuda \
  --json "$OUT/train-cuda-np$NP.json"

if [ "$BENCH" != 0 ]; then
  aware=$($PY -c "from mpitrain.backends.cuda_aware import detected; print(int(bool(detected().aware)))")
  policies=0
  if [ "$aware" = 1 ]; then policies="0 1"; fi
  for cuda_aware in $policies; do
    if [ "$cuda_aware" = 1 ]; then policy=cuda-aware; else policy=staged; fi
    export MPITRAIN_CUDA_AWARE=$cuda_aware
    step "allreduce-$policy" $MPI -np "$NP" -x MPITRAIN_CUDA_AWARE $PY -m benchmarks allreduce \
      -b 1M -e 1G -f 2 -n "$ITERS" -w 5 --array cupy --impl mpitrain,mpi --algorithm auto,ring \
      --json "$OUT/allreduce-$policy.json" --plot "$OUT/allreduce-$policy.png"
    for collective in reduce_scatter allgather broadcast; do
      step "$collective-$policy" $MPI -np "$NP" -x MPITRAIN_CUDA_AWARE $PY -m benchmarks \
        "$collective" -b 1M -e 256M -f 4 -n "$ITERS" -w 5 --array cupy --impl mpitrain,mpi \
        --json "$OUT/$collective-$policy.json"
    done
  done
fi
if [ "$status" = 0 ]; then echo "== done: every step passed; logs in $OUT"; else
  echo "== done: some step FAILED or HUNG (above); logs in $OUT"; fi
exit $status
