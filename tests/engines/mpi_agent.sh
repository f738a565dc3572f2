#!/usr/bin/env bash
# OpenMPI's remote shell for the test hosts (`mpirun --mca plm_rsh_agent THIS`): instead of ssh,
# enter the named host's namespaces and run the command there.
#
#   mpi_agent.sh HOST COMMAND...     (as mpirun calls it; ENGINES_STATE names the state folder)
set -euo pipefail
host=$1
shift
echo "agent: $host :: $*" >>"$ENGINES_STATE/logs/mpi-agent.log"
exec "$(dirname "$0")/nsrun.sh" "$ENGINES_STATE" "$host" /bin/sh -c "$*"
