#!/usr/bin/env bash
# Run a command "on" one of the test hosts: inside its network namespace, with its own host name,
# its own /etc/hosts and its own process namespace (so that nothing it starts outlives it).
#
#   nsrun.sh STATE_DIR NODE COMMAND [ARGS...]
#
# STATE_DIR holds `hosts` (the /etc/hosts of every test host; $NSRUN_HOSTS names another file
# for this command) and `netns-NODE` (the name of NODE's network namespace). The command runs as
# a child of a small shell that is process 1 of a fresh PID namespace: when this script's process
# (unshare, by then) is killed, the kernel kills everything inside. unshare blocks SIGTERM while it
# waits for that shell: stop it with SIGKILL.
#
# Where STATE also holds `cgroup-NODE` (only where a scenario asked for it: comm_hosts_slices in
# scenarios.sh), it names a cgroup directory, NODE's own share of the CPUs: this script moves itself
# into it before it execs, so the command and everything it starts run there. With NSRUN_LATE_SLICE=1
# it only exports that directory as ENGINES_CPU_SLICE, for a command that moves itself there once it
# has started (tests/engines/scripts/project_step.py): its start-up then runs at the machine's speed.
set -euo pipefail
state=$1 node=$2
shift 2
ns=$(cat "$state/netns-$node")
hosts=${NSRUN_HOSTS:-$state/hosts}
if [ -f "$state/cgroup-$node" ] && [ "${NSRUN_LATE_SLICE:-0}" = 1 ]; then
    # the command enters its slice itself once it has started (a job's rank, before its timed steps)
    ENGINES_CPU_SLICE=$(cat "$state/cgroup-$node")
    export ENGINES_CPU_SLICE
elif [ -f "$state/cgroup-$node" ]; then
    echo $$ >"$(cat "$state/cgroup-$node")/cgroup.procs"
fi
# shellcheck disable=SC2016  # the inner shell expands its own arguments
exec nsenter --net="/run/netns/$ns" -- \
    unshare --uts --mount --pid --fork --kill-child --mount-proc -- \
    /bin/bash -c 'hostname "$1"; mount --bind "$2" /etc/hosts; shift 2; "$@"; exit $?' \
    nsrun "$node" "$hosts" "$@"
