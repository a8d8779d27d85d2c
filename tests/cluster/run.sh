#!/usr/bin/env bash
# Run the multi-node suite (tests/cluster) on an emulated cluster of 3 hosts.
#
# Brings up 3 emulated nodes with tools/netcluster/cluster.sh (network namespaces, one
# hostname each, TCP between them, shared memory inside), runs the suite once per
# layout (ranks per node, in host order), then the topology tests once more through
# mpitrain-run (-H and --hostfile), and always tears the cluster down, even on failure
# or Ctrl-C. Needs root (ip netns, unshare); installs iproute2 and
# iputils-ping with apt-get when they are missing.
#
#   tests/cluster/run.sh                 # every layout below
#   tests/cluster/run.sh 2,2,2 1,3       # only these layouts
#
# environment: CLUSTER_NAME (default mpitrain-t), CLUSTER_SH (the cluster tool),
# PYTHON (default .venv/bin/python), PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cluster=${CLUSTER_SH:-$repo/tools/netcluster/cluster.sh}
python=${PYTHON:-$repo/.venv/bin/python}
export CLUSTER_NAME=${CLUSTER_NAME:-mpitrain-t}
export CLUSTER_MPI_BIN=${CLUSTER_MPI_BIN:-$(dirname "$python")}
export CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-300}
# 3 nodes x 2 ranks first; then 2-3 nodes with 1-3 ranks each, uneven ones included.
layouts=("$@")
((${#layouts[@]})) || layouts=(2,2,2 1,1 3,3 1,1,1 1,2 3,1 2,1,3)

[[ $(id -u) == 0 ]] || { echo "tests/cluster/run.sh: needs root (network namespaces)" >&2; exit 2; }
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v tc >/dev/null || missing+=(iproute2)
command -v ping >/dev/null || missing+=(iputils-ping)
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
[[ -x $python && -x $CLUSTER_MPI_BIN/mpiexec ]] \
  || { echo "tests/cluster/run.sh: no $python or $CLUSTER_MPI_BIN/mpiexec (run make first)" >&2; exit 2; }

trap '"$cluster" down >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM
"$cluster" up 3 --slots 2

failed=()
for layout in "${layouts[@]}"; do
  IFS=, read -r -a per_node <<< "$layout"
  hosts=() n=0 i=0
  for k in "${per_node[@]}"; do
    i=$((i + 1)); n=$((n + k)); hosts+=("$CLUSTER_NAME-n$i:$k")
  done
  echo "== tests/cluster with ranks per node $layout ($n ranks)"
  if ! (cd "$repo" && PYTHONPATH=$repo CLUSTER_LAYOUT=$layout "$cluster" run \
          -x PYTHONPATH -x CLUSTER_LAYOUT -H "$(IFS=,; echo "${hosts[*]}")" -n "$n" \
          sh tests/mpi_rank.sh "$python" -m pytest -p no:cacheprovider -q --color=no -rfE \
          ${PYTEST_ARGS:-} --with-mpi tests/cluster); then
    failed+=("$layout")
  fi
done
# mpitrain-run on the cluster: started on node 1, with PRRTE's remote agent and the
# cluster's subnet given through the environment (mpiexec and the ranks read it).
state=$(dirname "$("$cluster" hostfile)")
subnet=${CLUSTER_SUBNET:-10.77.0}.0/24
for where in "-H $CLUSTER_NAME-n1:2,$CLUSTER_NAME-n2:2|2,2" "--hostfile $state/hosts|2,2,2"; do
  args=${where%|*} layout=${where#*|}
  IFS=, read -r -a per_node <<< "$layout"; n=0
  for k in "${per_node[@]}"; do n=$((n + k)); done
  echo "== mpitrain-run $args -np $n (topology tests)"
  # shellcheck disable=SC2086  # $args is two words
  if ! (cd "$repo" && "$cluster" exec 1 env PYTHONPATH="$repo" CLUSTER_LAYOUT="$layout" \
          PRTE_MCA_plm_ssh_agent="$state/agent" PRTE_MCA_oob_tcp_if_include="$subnet" \
          OMPI_MCA_btl_tcp_if_include="$subnet" \
          "$python" -m mpitrain.run $args -np "$n" -x CLUSTER_LAYOUT \
          sh tests/mpi_rank.sh "$python" -m pytest -p no:cacheprovider -q --color=no -rfE \
          --with-mpi tests/cluster/test_cluster_topology.py); then
    failed+=("mpitrain-run $args")
  fi
done
if ((${#failed[@]})); then
  echo "== tests/cluster FAILED for: ${failed[*]}" >&2
  exit 1
fi
echo "== tests/cluster passed for layouts: ${layouts[*]}"
