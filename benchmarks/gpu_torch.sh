#!/bin/sh
# The torch GPU checks of mpitrain in one short command, for a GPU machine with little
# time (make gpu-check runs everything, at length):
#   sh benchmarks/gpu_torch.sh
# 1. tests/mpi/test_torch_distributed_cuda.py (the "mpitrain" torch.distributed backend on
#    CUDA tensors: its collectives, DDP with and without hooks, FSDP2, ranks out of step)
#    and tests/mpi/test_torch_cuda.py (mpitrain.torch on CUDA tensors) at 2 ranks;
# 2. training on CUDA at 2 ranks: python -m benchmarks train --device cuda with
#    mpitrain.torch, DDP over "mpitrain" and FSDP2 over "mpitrain", each checked against a
#    one-process reference;
# 3. the CuPy matrix of tests/mpi/test_gpu.py with the ipc and auto algorithms (staged) in
#    float32, bfloat16, float16 and int32 at 2 ranks, and its test that async operations
#    do not wait for a kernel queued later on the default stream;
# 4. step 1's backend module at 3 ranks;
# 5. the float32 allreduce benchmark at 2 ranks, ipc against the staged ring and MPI's own
#    collective on pinned copies, 1 MiB .. 256 MiB, every result checked;
# 6. where py-spy is found ($PYSPY, default py-spy on PATH; a copy of the static binary in
#    .venv/bin works there), FSDP2's ConvNet training on CUDA at 2 ranks sampled on every
#    thread into $OUT/fsdp2-stacks.RANK.txt, and the report of python -m benchmarks.stacks
#    on them in the step's log.
# Ranks share the node's GPUs (rank i uses GPU local_rank % count). Each step has its own
# limit ($STEP_S, default 150 s) within the script's $DEADLINE (default 420 s); a step that
# would start later is skipped and reported. Logs and JSON go to $OUT (default
# bench-results/gpu-torch). Settings: PY (default python3), MPIRUN (default mpirun),
# ITERS (default 10). The exit status is 1 if any step failed, hung or was skipped.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu-torch}
STEP_S=${STEP_S:-150}
DEADLINE=${DEADLINE:-420}
ITERS=${ITERS:-10}
. benchmarks/gpu_steps.sh
PYTEST="$PYTEST --timeout=120 --with-mpi"
$PY -c "
import cupy, torch
print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(),
      'torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/device.txt"

TORCH_TESTS="tests/mpi/test_torch_distributed_cuda.py tests/mpi/test_torch_cuda.py"
step torch-tests-np2 $MPI_TESTS -np 2 -x MPITRAIN_STALL_TIMEOUT_S=60 sh tests/mpi_rank.sh \
  $PYTEST $TORCH_TESTS
step train-cuda-np2 $MPI -np 2 $PY -m benchmarks train --device cuda \
  --impl mpitrain,ddp-mpitrain,fsdp-mpitrain --against reference --rounds 2 \
  --json "$OUT/train-cuda-np2.json"
MATRIX="(ipc or auto) and (float32 or bfloat16 or float16 or int32)"
step ipc-tests-np2 $MPI_TESTS -np 2 -x MPITRAIN_STALL_TIMEOUT_S=60 sh tests/mpi_rank.sh \
  $PYTEST -k "not fake and staged and (default_stream or $MATRIX)" tests/mpi/test_gpu.py
step torch-tests-np3 $MPI_TESTS -np 3 -x MPITRAIN_STALL_TIMEOUT_S=60 sh tests/mpi_rank.sh \
  $PYTEST tests/mpi/test_torch_distributed_cuda.py
step bench-allreduce-f32-np2 $MPI -np 2 $PY -m benchmarks allreduce -b 1M -e 256M -f 4 \
  -n "$ITERS" -w 3 --array cupy --impl mpitrain,mpi --outputs given --algorithm ipc,ring \
  --json "$OUT/allreduce-f32-np2.json"
PYSPY=${PYSPY:-$(command -v py-spy || true)}
if [ -n "$PYSPY" ]; then
  step profile-fsdp2-np2 sh -c "$MPI -np 2 sh -c 'exec $PYSPY record -r 200 --threads --idle \
    -f raw -o $OUT/fsdp2-stacks.\$OMPI_COMM_WORLD_RANK.txt -- $PY -m benchmarks train \
    --device cuda --impl fsdp-mpitrain --model convnet --rounds 1 --against reference' &&
    $PY -m benchmarks.stacks $OUT/fsdp2-stacks.*.txt --top 15"
else
  echo "== profile-fsdp2-np2: not run (no py-spy; set PYSPY)"
fi
if [ "$status" = 0 ]; then echo "== done: every step passed"; else
  echo "== done: some step FAILED, HUNG or was SKIPPED (above)"; fi
exit $status
