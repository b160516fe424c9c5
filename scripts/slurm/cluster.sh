#!/usr/bin/env bash
# A real SLURM cluster on this machine (Debian's slurm-wlm and munge), for the tests and for trying
# the sbatch template before a real cluster:
#
#   bash scripts/slurm/cluster.sh install     apt-get install slurm-wlm munge (root, or sudo)
#   bash scripts/slurm/cluster.sh start DIR   start munged, slurmctld and three slurmd, state in DIR;
#                                             prints the line to source: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/slurm/cluster.sh stop DIR    cancel its jobs, stop its daemons (whatever their state)
#
# Nothing outside DIR is touched but munged's socket (a folder of /tmp, removed by stop): munged
# gets a key of its own, the daemons run as the calling user on free ports. Partition "debug" (the
# default) is this host with all its CPUs, shared by jobs. Partition "gpu" is two more slurmd on
# this host, nodes gpu1 and gpu2 with 64 CPUs and 8 GPUs each: the scheduler checks a GPU job's
# request against them (`sbatch --test-only -p gpu JOB`), and a job step there gets SLURM's
# variables for its layout, but its GPUs are empty files in DIR/dev (no CUDA_VISIBLE_DEVICES).
set -euo pipefail

die() { echo "error: $*" >&2; exit 1; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null &&
     command -v srun >/dev/null; then
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null ||
      die "SLURM is not installed and installing it needs root: run 'sudo apt-get install slurm-wlm munge'"
    sudo=(sudo -n)
  fi
  command -v apt-get >/dev/null || die "SLURM is not installed and this is not a Debian/Ubuntu" \
    "machine: install slurm-wlm and munge with its package manager"
  echo "installing slurm-wlm and munge (Debian packages)" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null || die "apt-get update failed (no package mirror reachable?)"
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null ||
    die "apt-get install slurm-wlm munge failed"
}

free_ports() {  # N distinct free TCP ports
  python3 -c 'import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in held))' "$1"
}

start() {
  local dir=$1
  command -v slurmctld >/dev/null || die "slurmctld not found: run 'bash $0 install' first"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ -e "$dir/slurm.conf" ] && die "$dir already holds a cluster (stop it first, or pick another folder)"
  trap "stop '$dir'" EXIT  # a cluster that did not come up whole is taken down
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  head -c 1024 /dev/urandom > "$dir/munge.key"
  chmod 400 "$dir/munge.key"
  # munged wants every folder above its socket searchable by all (DIR's may not be): one of /tmp
  local sockets
  sockets=$(mktemp -d /tmp/jaxshard-munge.XXXXXX)
  chmod 755 "$sockets"
  echo "$sockets" > "$dir/munge.sockets"
  munged --socket="$sockets/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" ||
    die "munged did not start (see $dir/log/munged.log)"

  local host user cpus ports
  read -r -a ports <<< "$(free_ports 4)"
  host=$(hostname -s)
  user=$(id -un)
  cpus=$(nproc)
  cat > "$dir/slurm.conf" <<EOF
# A one-node test cluster, written by scripts/slurm/cluster.sh.
ClusterName=jaxshard
# (JAX puts a SLURM job's coordinator on port 61440 + job id % 4096: a random first id keeps two
# clusters on one machine, each counting from its own, off each other's ports)
FirstJobId=$((1000 + RANDOM % 30000))
SlurmctldHost=$host
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sockets/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
KillWait=5
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus State=UNKNOWN
NodeName=gpu1 NodeAddr=127.0.0.1 Port=${ports[2]} CPUs=64 Gres=gpu:8 State=UNKNOWN
NodeName=gpu2 NodeAddr=127.0.0.1 Port=${ports[3]} CPUs=64 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=gpu Nodes=gpu[1-2] MaxTime=INFINITE State=UP
EOF
  cat > "$dir/gres.conf" <<EOF
NodeName=gpu[1-2] Name=gpu File=$dir/dev/gpu[0-7]
EOF
  mkdir -p "$dir/dev"
  touch "$dir"/dev/gpu{0..7}
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" || die "slurmctld did not start (see $dir/log/slurmctld.log)"
  local node
  for node in "$host" gpu1 gpu2; do
    slurmd -f "$SLURM_CONF" -N "$node" || die "slurmd did not start (see $dir/log/slurmd-$node.log)"
  done
  local waited=0
  until [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$')" = 3 ]; do
    waited=$((waited + 1))
    [ "$waited" -gt 60 ] && die "the nodes did not come up within 30 s (see $dir/log/)"
    sleep 0.5
  done
  trap - EXIT
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local dir=$1 pid f alive
  if [ -f "$dir/slurm.conf" ] && [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    export SLURM_CONF=$dir/slurm.conf  # cancel what still runs, so no job outlives its cluster
    if [ -n "$(squeue -h 2>/dev/null)" ]; then
      scancel --user="$(id -un)" 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  local pids=()
  for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    rm -f "$f"  # (a second stop must not signal a pid reused since)
    grep -qE '^(slurmd|slurmctld|munged)$' "/proc/$pid/comm" 2>/dev/null && pids+=("$pid")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
      alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.1
    done
    kill -9 "${pids[@]}" 2>/dev/null || true
  fi
  if [ -f "$dir/munge.sockets" ]; then
    rm -rf "$(cat "$dir/munge.sockets")"
    rm -f "$dir/munge.sockets"
  fi
}

case "${1:-}" in
  install) install ;;
  start) [ $# = 2 ] || die "usage: $0 start DIR"; start "$2" ;;
  stop) [ $# = 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
