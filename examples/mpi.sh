#!/usr/bin/env bash
# Start a lockstep script with OpenMPI's mpirun: mpirun places the processes, and each one reads
# its rank, local rank and node from OMPI_COMM_WORLD_* (no `lockstep run` needed). Every rank
# derives the same store port from the MPI job id; MASTER_ADDR names rank 0's host.
#
#   examples/mpi.sh 2 examples/allreduce_rank.py                          # 2 processes on this host
#   HOSTS=node0:4,node1:4 examples/mpi.sh 8 examples/mnist_convnet.py     # 4 on each of two hosts
#   MPIRUN_ARGS="--allow-run-as-root" examples/mpi.sh 2 train.py --epochs 3
#
# Variables: HOSTS (mpirun --host, host:slots,...; ranks fill the first host's slots first),
# MASTER_ADDR (default: the first host of HOSTS, or this host), MASTER_PORT (default: derived
# from the job id), PYTHON (default: python), MPIRUN_ARGS (more mpirun flags, e.g. the network
# interfaces: --mca btl_tcp_if_include eth0).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NPROCS script.py [args...]" >&2
    exit 2
fi
nprocs=$1
shift
hosts=${HOSTS:-}
first=${hosts%%,*}
master=${MASTER_ADDR:-${first%%:*}}
master=${master:-$(hostname)}
args=(-np "$nprocs" --map-by slot -x "MASTER_ADDR=$master" -x PATH -x "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
[ -n "$hosts" ] && args+=(--host "$hosts")
[ -n "${MASTER_PORT:-}" ] && args+=(-x "MASTER_PORT=$MASTER_PORT")
# shellcheck disable=SC2206  # MPIRUN_ARGS is a list of flags, split on spaces
extra=(${MPIRUN_ARGS:-})
exec mpirun "${args[@]}" "${extra[@]}" "${PYTHON:-python}" "$@"
