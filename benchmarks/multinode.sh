#!/usr/bin/env bash
# The multi-node benchmarks of BENCHMARKS.md, on an emulated cluster (root).
#
# Brings up 3 emulated nodes (tools/netcluster/cluster.sh), then for each link rate and
# node count runs `python -m benchmarks COLLECTIVE` twice: with Open MPI's defaults
# (coll/han across nodes) and with `--mca coll ^han` (flat native baseline); both runs
# time mpitrain's flat ring and hierarchical side by side with the native call. Writes
# OUT/<collective>-<rate>-<nodes>n-<han|flat>.{txt,json}; always tears the cluster down.
#
#   benchmarks/multinode.sh [OUT]       (default bench-results/multinode)
#
# environment: RATES (default "200mbit 1gbit"), NODES (default "2 3"), RANKS_PER_NODE
# (default 2), COLLECTIVES (default allreduce), ITERS (default 10), MAXBYTES (default
# 16M at 200mbit, 64M above), CLUSTER_NAME (default mpitrain-b).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/bench-results/multinode}
cluster=${CLUSTER_SH:-$repo/tools/netcluster/cluster.sh}
python=${PYTHON:-$repo/.venv/bin/python}
export CLUSTER_NAME=${CLUSTER_NAME:-mpitrain-b}
export CLUSTER_MPI_BIN=${CLUSTER_MPI_BIN:-$(dirname "$python")}
per=${RANKS_PER_NODE:-2}
mkdir -p "$out"
trap '"$cluster" down >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM
"$cluster" up 3 --slots "$per"
for rate in ${RATES:-200mbit 1gbit}; do
  "$cluster" shape --rate "$rate" >/dev/null
  maxbytes=${MAXBYTES:-$([[ $rate == 200mbit ]] && echo 16M || echo 64M)}
  for nodes in ${NODES:-2 3}; do
    hosts=$(for ((i = 1; i <= nodes; i++)); do printf '%s-n%d:%d,' "$CLUSTER_NAME" "$i" "$per"; done)
    for coll in ${COLLECTIVES:-allreduce}; do
      for native in han flat; do
        extra=(); [[ $native == flat ]] && extra=(--mca coll ^han)
        tag=$coll-$rate-${nodes}n-$native
        echo "== $tag (load $(cut -d' ' -f1-3 /proc/loadavg))"
        (cd "$repo" && PYTHONPATH=$repo "$cluster" run -x PYTHONPATH -H "${hosts%,}" \
            -n $((nodes * per)) "${extra[@]}" "$python" -m benchmarks "$coll" -b 4K \
            -e "$maxbytes" -f 4 -n "${ITERS:-10}" -w 2 --impl mpitrain,mpi \
            --algorithm ring,hierarchical --no-inplace --json "$out/$tag.json") \
          2>&1 | grep -v 'setpgid' | tee "$out/$tag.txt"
      done
    done
  done
done
