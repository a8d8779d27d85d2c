#!/bin/sh
# The device-link checks of mpitrain on one GPU machine, in one command:
#   sh benchmarks/gpu_links.sh
# 1. CUDA IPC: the GPU test matrix (tests/mpi/test_gpu.py, real GPU cases) with the
#    ipc and auto algorithms at 2 and 3 ranks sharing GPU 0;
# 2. NCCL: the same matrix with the nccl algorithm at 2 and 3 ranks on one GPU, each
#    rank with its own NCCL_HOSTID (NCCL refuses ranks of one GPU otherwise; correct,
#    not fast: network-transport speed);
# 3. benchmarks at 2 ranks: allreduce (float32 and bfloat16), reduce_scatter and
#    allgather, 1 MiB .. 256 MiB, ipc against the staged ring and MPI's own collective
#    on pinned copies, every result checked; allreduce at 4 ranks (busbw); and where
#    ipc and staging cross over: allreduce and allgather from 256 B to 1 MiB at 2 ranks
#    (what auto picks for the small calls of FSDP and hook-less training).
# TESTS=0 skips the test steps (1 and 2). NCCL_RANKS (default "2 3") lists the rank
# counts of the NCCL tests ("" for none).
# Each step has its own time limit ($STEP_S, and what is left of $DEADLINE s for the
# whole script: a step that would start later is skipped and reported); tables and logs
# go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu-links}
STEP_S=${STEP_S:-120}
DEADLINE=${DEADLINE:-540}
ITERS=${ITERS:-10}
NCCL_RANKS=${NCCL_RANKS-2 3}  # "": no NCCL tests
TESTS=${TESTS:-1}
if [ "$TESTS" = 0 ]; then NCCL_RANKS=""; fi
. benchmarks/gpu_steps.sh
PYTEST="$PYTEST --timeout=120 --with-mpi"
$PY -c "
import cupy
from cupy.cuda import nccl
print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(),
      'NCCL', nccl.get_version())" | tee -a "$OUT/device.txt"

[ "$TESTS" = 0 ] || step ipc-tests-np2 $MPI_TESTS -np 2 -x MPITRAIN_STALL_TIMEOUT_S=60 sh tests/mpi_rank.sh \
  $PYTEST -k "not fake and (ipc or auto)" tests/mpi/test_gpu.py

BENCH="$PY -m benchmarks"
COMMON="-b 1M -e 256M -f 4 -n $ITERS -w 3 --array cupy --impl mpitrain,mpi --outputs given"
step bench-allreduce-f32-np2 $MPI -np 2 $BENCH allreduce $COMMON --algorithm ipc,ring \
  --json "$OUT/allreduce-f32-np2.json"
step bench-allreduce-bf16-np2 $MPI -np 2 $BENCH allreduce $COMMON -d bfloat16 \
  --algorithm ipc,ring --json "$OUT/allreduce-bf16-np2.json"
step bench-reduce_scatter-np2 $MPI -np 2 $BENCH reduce_scatter $COMMON --algorithm ipc,ring \
  --json "$OUT/reduce_scatter-np2.json"
step bench-allgather-np2 $MPI -np 2 $BENCH allgather $COMMON --algorithm ipc,ring \
  --json "$OUT/allgather-np2.json"
step bench-allreduce-f32-np4 $MPI -np 4 $BENCH allreduce -b 1M -e 256M -f 16 -n $ITERS -w 3 \
  --array cupy --impl mpitrain,mpi --outputs given --algorithm ipc \
  --json "$OUT/allreduce-f32-np4.json"
for collective in allreduce allgather; do
  step "bench-$collective-small-np2" $MPI -np 2 $BENCH $collective -b 256 -e 1M -f 4 \
    -n 20 -w 3 --array cupy --impl mpitrain,mpi --outputs given --algorithm ipc,ring,auto \
    --json "$OUT/$collective-small-np2.json"
done
for n in 3; do
  [ "$TESTS" = 0 ] || step "ipc-tests-np$n" $MPI_TESTS -np $n -x MPITRAIN_STALL_TIMEOUT_S=60 sh tests/mpi_rank.sh \
    $PYTEST -k "not fake and (ipc or auto)" tests/mpi/test_gpu.py
done
for n in $NCCL_RANKS; do
  step "nccl-tests-np$n" $MPI_TESTS -np $n -x MPITRAIN_STALL_TIMEOUT_S=60 sh -c \
    'NCCL_HOSTID=h$OMPI_COMM_WORLD_RANK exec sh tests/mpi_rank.sh "$@"' sh \
    $PYTEST -k "not fake and nccl" tests/mpi/test_gpu.py
done
if [ "$status" = 0 ]; then echo "== done: every step passed"; else echo "== done: some step FAILED"; fi
exit $status
