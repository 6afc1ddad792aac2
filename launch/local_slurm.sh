#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, from Debian's packages (slurm-wlm, munge).
#
#   launch/local_slurm.sh           install what is missing, start munge + slurmctld + slurmd, wait for the node
#   launch/local_slurm.sh --status  print whether the node is up (exit 0) or not (exit 1); changes nothing
#
# Idempotent: a second call finds the daemons running with the same slurm.conf and only waits for the node.
# Made for CI and laptops: no systemd (containers have none), no cgroups (proctrack/linuxproc, task/none), no
# accounting daemon. One node named after this host with all its CPUs (and its NVIDIA GPUs as gres, if any) in
# one default partition "local". Needs root, or passwordless sudo.
#
# Exit status: 0 the node is up; 3 Slurm could not be installed (tests skip on it); 1 anything else
# (the message and the end of the daemon logs say why).
#
# Environment: LOCAL_SLURM_TIMEOUT_S (default 60) bounds the wait for the node.
set -euo pipefail

TIMEOUT_S=${LOCAL_SLURM_TIMEOUT_S:-60}
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
NODE=$(hostname -s)

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "local_slurm: needs root or passwordless sudo to install and start Slurm" >&2
  exit 3
fi

say() { echo "local_slurm: $*"; }

node_state() {
  # "idle", "mixed", "allocated", "down*", ... or empty when slurmctld does not answer
  timeout 10 sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n1 || true
}

node_is_up() {
  case "$(node_state)" in
    idle | mixed | allocated | completing) return 0 ;;
    *) return 1 ;;
  esac
}

if [ "${1:-}" = "--status" ]; then
  state=$(command -v sinfo >/dev/null && node_state || true)
  echo "${state:-no slurm}"
  node_is_up
  exit
fi

install_if_missing() {
  local missing=()
  for cmd in munged slurmctld slurmd sbatch; do
    command -v "$cmd" >/dev/null || PATH=$PATH:/usr/sbin command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if ! command -v apt-get >/dev/null; then
    echo "local_slurm: ${missing[*]} missing and no apt-get to install slurm-wlm and munge" >&2
    exit 3
  fi
  say "installing slurm-wlm and munge (missing: ${missing[*]})"
  if ! { "${SUDO[@]}" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
      slurm-wlm munge >/tmp/local_slurm_apt.log 2>&1; }; then
    tail -n 20 /tmp/local_slurm_apt.log >&2 || true
    echo "local_slurm: apt-get could not install slurm-wlm and munge" >&2
    exit 3
  fi
}

running() { pgrep -x "$1" >/dev/null; }

start_munge() {
  "${SUDO[@]}" install -d -o munge -g munge -m 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    "${SUDO[@]}" runuser -u munge -- /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key
  fi
  if ! running munged; then
    say "starting munged"
    "${SUDO[@]}" runuser -u munge -- /usr/sbin/munged
  fi
  local deadline=$((SECONDS + 15))
  until munge -n </dev/null | unmunge >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { echo "local_slurm: munged does not answer" >&2; exit 1; }
    sleep 0.5
  done
}

gpu_count() {
  ls /dev/nvidia[0-9]* 2>/dev/null | wc -l
}

write_conf() {
  # Prints "changed" when slurm.conf (or gres.conf) had to be rewritten.
  local cpus gpus gres_line="" gres_types="" conf
  cpus=$(nproc --all)
  gpus=$(gpu_count)
  if [ "$gpus" -gt 0 ]; then
    gres_types="GresTypes=gpu"
    gres_line=" Gres=gpu:$gpus"
  fi
  conf=$(
    cat <<EOF
# Written by launch/local_slurm.sh: a single-node cluster for tests and local runs.
ClusterName=local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
$gres_types
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus$gres_line State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  )
  "${SUDO[@]}" install -d -m 0755 "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
  local changed=""
  if [ "$(cat "$CONF_DIR/slurm.conf" 2>/dev/null)" != "$conf" ]; then
    printf '%s\n' "$conf" | "${SUDO[@]}" tee "$CONF_DIR/slurm.conf" >/dev/null
    changed=changed
  fi
  if [ "$gpus" -gt 0 ]; then
    local gres="AutoDetect=off
Name=gpu File=/dev/nvidia[0-$((gpus - 1))]"
    if [ "$(cat "$CONF_DIR/gres.conf" 2>/dev/null)" != "$gres" ]; then
      printf '%s\n' "$gres" | "${SUDO[@]}" tee "$CONF_DIR/gres.conf" >/dev/null
      changed=changed
    fi
  fi
  echo "$changed"
}

stop_daemon() {
  local name=$1 pid
  pid=$(pgrep -x "$name" || true)
  [ -n "$pid" ] || return 0
  say "stopping $name ($pid) to load the new slurm.conf"
  "${SUDO[@]}" kill "$pid"
  local deadline=$((SECONDS + 15))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
}

start_slurm() {
  local changed=$1
  if [ -n "$changed" ]; then
    stop_daemon slurmd
    stop_daemon slurmctld
  fi
  if ! running slurmctld; then
    say "starting slurmctld"
    "${SUDO[@]}" /usr/sbin/slurmctld
  fi
  if ! running slurmd; then
    say "starting slurmd"
    "${SUDO[@]}" /usr/sbin/slurmd -N "$NODE"
  fi
}

wait_for_node() {
  local deadline=$((SECONDS + TIMEOUT_S)) state resumed=""
  while :; do
    state=$(node_state)
    case "$state" in
      idle | mixed | allocated | completing)
        say "node $NODE is $state"
        return 0
        ;;
      down* | drain*)
        # A restarted slurmd leaves the node down or drained; this machine is the whole cluster, so resume it.
        if [ -z "$resumed" ]; then
          "${SUDO[@]}" scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true
          resumed=yes
        fi
        ;;
    esac
    if [ $SECONDS -ge $deadline ]; then
      echo "local_slurm: node $NODE is '${state:-not answering}' after ${TIMEOUT_S}s; daemon logs:" >&2
      "${SUDO[@]}" tail -n 15 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
      exit 1
    fi
    sleep 1
  done
}

export PATH=$PATH:/usr/sbin
install_if_missing
start_munge
changed=$(write_conf)
start_slurm "$changed"
wait_for_node
