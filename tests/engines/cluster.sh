# shellcheck shell=bash
# The test hosts and daemons of `make test-engines`, sourced by run.sh: three network namespaces
# plugged into a bridge in a fourth (node0 = 192.0.2.1, node1 = 192.0.2.2, node2 = 192.0.2.3,
# TEST-NET-1), munge, a Slurm controller and one slurmd on node0 and node1. Everything lives in
# $STATE; every daemon runs under nsrun.sh, in its own PID namespace, so killing the recorded pid
# ends it with all it started.
#
# Functions: hosts_up, munge_up, slurm_up, cluster_down (idempotent; safe after a partial start),
# cgroup_remove.

NODES=(node0 node1 node2)
ADDRS=(192.0.2.1 192.0.2.2 192.0.2.3)
SLURM_PORT_CTLD=16817
SLURM_PORT_D=16818

on() {  # on NODE COMMAND...: run COMMAND on a test host
    "$ENGINES_DIR/nsrun.sh" "$STATE" "$@"
}

log() { printf '%s\n' "$*" >&2; }

# Start a long-lived process on NODE in the background; record its pid for cluster_down.
daemon() {  # daemon NAME NODE COMMAND...
    local name=$1 node=$2
    shift 2
    # nsrun.sh itself, not the `on` function: $! must be the process that owns the namespace
    "$ENGINES_DIR/nsrun.sh" "$STATE" "$node" "$@" >"$STATE/logs/daemon-$name.log" 2>&1 </dev/null &
    echo "$!" >"$STATE/pids/$name"
}

hosts_up() {
    local suffix=$$ i ns sw host port
    mkdir -p "$STATE/pids" "$STATE/logs"
    {
        echo "127.0.0.1 localhost"
        for i in "${!NODES[@]}"; do echo "${ADDRS[$i]} ${NODES[$i]}"; done
    } >"$STATE/hosts"
    # a switch: one more namespace holding a bridge, with every host's eth1 plugged into it
    sw="lockstep-e2e-$suffix-sw"
    echo "$sw" >"$STATE/netns-switch"
    ip netns add "$sw" || return 1
    ip -n "$sw" link add br0 type bridge || return 1
    ip -n "$sw" link set br0 up || return 1
    for i in "${!NODES[@]}"; do
        ns="lockstep-e2e-$suffix-$i"
        echo "$ns" >"$STATE/netns-${NODES[$i]}"
        ip netns add "$ns" || return 1
        # each pair is made under names unique on this machine (at most 15 characters), then the
        # host's end is called eth1 inside its host, as a cluster's nodes name their interfaces alike
        host="lse${suffix}h$i" port="lse${suffix}s$i"
        ip link add "$host" type veth peer name "$port" || return 1
        ip link set "$host" netns "$ns" || return 1
        ip link set "$port" netns "$sw" || return 1
        ip -n "$sw" link set "$port" master br0 || return 1
        ip -n "$sw" link set "$port" up || return 1
        ip -n "$ns" link set "$host" name eth1 || return 1
        ip -n "$ns" link set lo up || return 1
        ip -n "$ns" addr add "${ADDRS[$i]}/24" dev eth1 || return 1
        ip -n "$ns" link set eth1 up || return 1
    done
}

munge_up() {
    local dir="$STATE/munge" i
    mkdir -p "$dir"
    chmod 755 "$STATE" "$dir"
    head -c 1024 /dev/urandom >"$dir/munge.key"
    chown munge:munge "$dir" "$dir/munge.key"
    chmod 400 "$dir/munge.key"
    # munged checks that its socket folder belongs to munge and is not writable by others
    daemon munged node0 runuser -u munge -- munged --foreground --socket="$dir/munge.socket" \
        --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed" \
        --log-file="$dir/munged.log"
    for i in $(seq 100); do
        munge -S "$dir/munge.socket" -n </dev/null 2>/dev/null | unmunge -S "$dir/munge.socket" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "munged did not start: $(cat "$STATE/logs/daemon-munged.log" 2>/dev/null)"
    return 1
}

write_slurm_conf() {
    local dir=$STATE/slurm
    mkdir -p "$dir/state" "$dir/node0" "$dir/node1" "$dir/log"
    cat >"$dir/slurm.conf" <<EOF
ClusterName=lockstep-e2e
SlurmctldHost=node0(192.0.2.1)
SlurmctldPort=$SLURM_PORT_CTLD
SlurmdPort=$SLURM_PORT_D
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=120
InactiveLimit=0
KillWait=60
MinJobAge=600
JobRequeue=1
SchedulerParameters=bf_interval=2
NodeName=node0 NodeAddr=192.0.2.1 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=node1 NodeAddr=192.0.2.2 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=main Nodes=node0,node1 Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP
EOF
}

slurm_up() {
    write_slurm_conf
    export SLURM_CONF=$STATE/slurm/slurm.conf
    daemon slurmctld node0 slurmctld -D -f "$SLURM_CONF"
    daemon slurmd-node0 node0 slurmd -D -N node0 -f "$SLURM_CONF"
    daemon slurmd-node1 node1 slurmd -D -N node1 -f "$SLURM_CONF"
    local i states
    for i in $(seq 300); do
        states=$(on node0 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ')
        case "$states" in
            "node0 idle node1 idle ") return 0 ;;
        esac
        sleep 0.2
    done
    log "the Slurm nodes did not come up (sinfo: ${states:-nothing}); see $STATE/slurm/log"
    return 1
}

kill_recorded() {  # kill_recorded NAME: end a process this script started, by its recorded pid
    # SIGKILL at once: unshare --fork blocks SIGTERM while it waits, and the daemons keep nothing
    # worth a clean shutdown; unshare's death kills the namespace's first process, and with it the rest
    local file="$STATE/pids/$1" pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    rm -f "$file"
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 0
}

cgroup_remove() {  # cgroup_remove FILE: remove the cgroup FILE names (a host's CPU slice), and FILE
    local dir pid
    dir=$(cat "$1")
    for _ in $(seq 50); do  # what still runs there (after a failure) is ended first, then the group goes
        [ -d "$dir" ] || break
        while read -r pid; do kill -KILL "$pid" 2>/dev/null; done 2>/dev/null <"$dir/cgroup.procs"
        rmdir "$dir" 2>/dev/null && break
        sleep 0.1
    done
    [ -d "$dir" ] && log "could not remove the cgroup $dir"
    rm -f "$1"
}

cluster_down() {
    [ -n "${STATE:-}" ] && [ -d "$STATE" ] || return 0
    local name file
    # a scenario's hosts' CPU slices where it was killed before it removed them
    for file in "$STATE"/work/*/cgroup-d*; do [ -f "$file" ] && cgroup_remove "$file"; done
    # no scancel first: killing each slurmd's PID namespace ends every job step it started
    # the scenarios' own background processes, then the daemons (each in its own PID namespace)
    for file in "$STATE"/pids/*; do
        name=${file##*/}
        case $name in slurm* | munged | "*") ;; *) kill_recorded "$name" ;; esac
    done
    for name in slurmd-node0 slurmd-node1 slurmctld munged; do kill_recorded "$name"; done
    local veth ns
    for node in "${NODES[@]}" switch; do
        [ -f "$STATE/netns-$node" ] || continue
        ns=$(cat "$STATE/netns-$node")
        ip netns del "$ns" 2>/dev/null  # takes the veth pair with it
        rm -f "$STATE/netns-$node"
    done
    if [ -f "$STATE/veth" ]; then
        veth=$(cat "$STATE/veth")
        ip link del "$veth" 2>/dev/null
        rm -f "$STATE/veth"
    fi
    # `ip netns add` made /run/netns a mount point of its own; undo that when it was us and it is empty
    if [ -f "$STATE/created-run-netns" ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
        local _
        for _ in 1 2 3 4 5; do
            mountpoint -q /run/netns || break
            umount /run/netns 2>/dev/null || break
        done
        rmdir /run/netns 2>/dev/null
        rm -f "$STATE/created-run-netns"
    fi
    return 0
}
