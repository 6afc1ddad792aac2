# shellcheck shell=bash
# Ray on a Slurm allocation: a head on this node (the batch host), one worker on every other node through srun,
# a bounded wait until every node has joined, and a teardown that stops only this job's Ray processes.
# Sourced by launch/slurm_ray.sbatch and by the setup lines of the Hydra Slurm launcher
# (configs/hydra/launcher/slurm.yaml), so both bring their cluster up the same way:
#
#   source launch/ray_cluster.sh
#   ray_cluster_up       # exports RAY_ADDRESS (so ray.init(address="auto") joins this cluster) and traps
#                        # EXIT/INT/TERM to call ray_cluster_down
#
# Every node detects its own address, picks free ports (several jobs may share a node, and other Ray instances
# may run there) and keeps its Ray session in /tmp/ray-<job id> (Unix sockets need a short local path); at
# teardown each node copies its Ray logs to $RAY_CLUSTER_LOG_DIR/ray-logs/<node>/.
#
# Settings (environment):
#   RAY_CLUSTER_PYTHON   the python that has ray (default: python3 on PATH)
#   RAY_CLUSTER_LOG_DIR  the job directory for logs, on a filesystem every node sees (default: ./ray-<job id>)
#   RAY_CLUSTER_IFACE    network interface whose IPv4 address every node uses (e.g. ib0); default: the
#                        address the node's name resolves to, else the source address of its default route,
#                        else the first of `hostname -I`
#   RAY_CLUSTER_WAIT_S   how long to wait for the head and for all nodes to join (default 300)
#   RAY_OBJECT_STORE_MB  object store per node (default: Ray's choice)
#   RAY_START_ARGS       extra arguments for every `ray start` (site port ranges, custom resources, ...)
#   RAY_CLUSTER_TERM_GRACE_S  seconds each Ray process gets to stop after scancel/timeout (default 3; Slurm
#                        kills what is left KillWait seconds after its SIGTERM, so the logs are best effort then)
#   RAY_CLUSTER_START_ATTEMPTS  tries of `ray start` per node (default 3)
#   RAY_AUTH_MODE        Ray's token authentication. Unset (the default): on, with a fresh token for this job in
#                        $RAY_CLUSTER_LOG_DIR/ray_auth_token (mode 600, removed at teardown); "token" with your own
#                        RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; "disabled" turns it off (Ray's servers listen on every
#                        interface of the node: anyone who reaches them could run code as you)

_rc_log() { echo "[ray_cluster $(date +%H:%M:%S) $(hostname -s)] $*"; }
_rc_err() { echo "[ray_cluster $(date +%H:%M:%S) $(hostname -s)] error: $*" >&2; }

_RC_LIB=$(readlink -f "${BASH_SOURCE[0]}")

_rc_python() { "${RAY_CLUSTER_PYTHON:-python3}" "$@"; }

# `ray start ...` through the configured python, so no `ray` executable has to be on PATH. Call it with `&`:
# the exec makes the background subshell the Ray process itself, so $! is what a signal must reach (and Ray
# stays inside the job's process tree, where Slurm finds it).
_rc_ray() {
  exec "${RAY_CLUSTER_PYTHON:-python3}" -c \
    'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"
}

# Prints "<ipv4> <port> <port> ..." : this node's address for Ray and $1 ports that are free right now.
_rc_probe() {
  _rc_python - "${RAY_CLUSTER_IFACE:-}" "$1" <<'EOF'
import fcntl
import socket
import struct
import subprocess
import sys

iface, num_ports = sys.argv[1], int(sys.argv[2])


def iface_address(name):
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # SIOCGIFADDR
        packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    except OSError as err:
        sys.exit(f"RAY_CLUSTER_IFACE={name}: no IPv4 address on that interface ({err})")
    return socket.inet_ntoa(packed[20:24])


def default_address():
    try:
        resolved = socket.gethostbyname(socket.gethostname())
        if not resolved.startswith("127."):
            return resolved
    except OSError:
        pass
    try:  # the source address of the default route; connect() on UDP sends nothing
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]
    except OSError:
        pass
    found = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    ipv4 = [a for a in found if a.count(".") == 3 and not a.startswith("127.")]
    return ipv4[0] if ipv4 else "127.0.0.1"


sockets = [socket.socket() for _ in range(num_ports)]
for s in sockets:
    s.bind(("", 0))
ports = [s.getsockname()[1] for s in sockets]
print(iface_address(iface) if iface else default_address(), *ports)
EOF
}

# GPUs Slurm gave this step on this node (CUDA_VISIBLE_DEVICES when set, else SLURM_GPUS_ON_NODE, else 0).
_rc_gpus_here() {
  local visible=${CUDA_VISIBLE_DEVICES:-}
  if [ -n "$visible" ] && [ "$visible" != "NoDevFiles" ]; then
    local ids
    IFS=, read -r -a ids <<<"$visible"
    echo "${#ids[@]}"
  else
    echo "${SLURM_GPUS_ON_NODE:-0}"
  fi
}

# SLURM_JOB_CPUS_PER_NODE ("72(x2),36") expanded to one count per node, in the order of the node list.
_rc_cpus_per_node() {
  local part parts count times i out=()
  IFS=, read -r -a parts <<<"${SLURM_JOB_CPUS_PER_NODE:-1}"
  for part in "${parts[@]}"; do
    count=${part%%(*}
    times=1
    [[ $part == *"(x"* ]] && times=${part#*(x} && times=${times%)}
    for ((i = 0; i < times; i++)); do out+=("$count"); done
  done
  echo "${out[@]}"
}

# The common arguments of every node's `ray start`.
_rc_start_args() {
  local cpus=$1 gpus=$2 ip=$3 agent_port=$4
  local args=(
    --block --node-ip-address="$ip" --num-cpus="$cpus" --num-gpus="$gpus"
    --temp-dir="/tmp/ray-$SLURM_JOB_ID" --dashboard-agent-listen-port="$agent_port"
    --min-worker-port=0 --max-worker-port=0 --disable-usage-stats
  )
  [ -n "${RAY_OBJECT_STORE_MB:-}" ] && args+=(--object-store-memory=$((RAY_OBJECT_STORE_MB * 1024 * 1024)))
  # shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
  [ -n "${RAY_START_ARGS:-}" ] && args+=($RAY_START_ARGS)
  echo "${args[@]}"
}

# Last resort after a stop: kill what is left of this job's Ray session on this node (processes whose command
# line names its temp dir, which no other job uses).
_rc_kill_leftovers() {
  local proc cmd args pids=()
  for proc in /proc/[0-9]*; do
    # Builtins only: this runs against Slurm's KillWait, and a fork per process is slow on a busy node.
    { mapfile -d '' -t args <"$proc/cmdline"; } 2>/dev/null || continue
    cmd="${args[*]} "
    if [[ $cmd == *"/tmp/ray-$SLURM_JOB_ID/"* || $cmd == *"--temp-dir=/tmp/ray-$SLURM_JOB_ID "* ]]; then
      pids+=("${proc#/proc/}")
    fi
  done
  if [ ${#pids[@]} -gt 0 ]; then
    _rc_log "killing ${#pids[@]} leftover Ray processes of this job"
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
}

_rc_save_logs() {
  local session=/tmp/ray-$SLURM_JOB_ID/session_latest/logs dest
  dest=$RAY_CLUSTER_LOG_DIR/ray-logs/$(hostname -s)
  if [ -d "$session" ]; then
    mkdir -p "$dest" && cp -rL "$session/." "$dest/" 2>/dev/null || true
  fi
  _rc_kill_leftovers
  rm -rf "/tmp/ray-$SLURM_JOB_ID"
}

# Stop a `ray start --block` (or the srun running one): SIGTERM makes Ray drain and stop its processes.
_rc_stop() {
  local pid=$1 grace=$2 deadline
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + grace))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# One worker node (runs inside `srun` on that node): join the head, block until stopped, save the logs.
# A `ray start` that fails (a busy node can miss Ray's 30 s raylet registration) is retried.
_ray_cluster_worker() {
  local address=$1 cpus=$2 gpus ip agent_port pid=0 rc attempt attempts=${RAY_CLUSTER_START_ATTEMPTS:-3}
  gpus=$(_rc_gpus_here)
  trap '_rc_stop $pid "${RAY_CLUSTER_TERM_GRACE_S:-3}"; _rc_save_logs; exit 0' TERM INT
  for ((attempt = 1; ; attempt++)); do
    read -r ip agent_port < <(_rc_probe 1) || exit 1
    rm -rf "/tmp/ray-$SLURM_JOB_ID"
    _rc_log "worker $ip joins $address with $cpus CPUs, $gpus GPUs (attempt $attempt of $attempts)"
    # shellcheck disable=SC2046
    _rc_ray start --address="$address" $(_rc_start_args "$cpus" "$gpus" "$ip" "$agent_port") &
    pid=$!
    rc=0
    wait "$pid" || rc=$?
    [ "$rc" -ne 0 ] && [ "$attempt" -lt "$attempts" ] || break
  done
  _rc_save_logs
  exit "$rc"
}

# Wait until Ray lists $1 alive nodes, for at most $2 seconds; fail as soon as a process in $3... (the head,
# the srun of a worker) has ended. The watching is done here, not in Python: ray.init itself can hang for
# minutes on a head that died.
_rc_wait_nodes() {
  local want=$1 timeout=$2 waiter pid rc=0 deadline
  shift 2
  deadline=$((SECONDS + timeout))
  _rc_python - "$RAY_ADDRESS" "$want" <<'EOF' &
import sys
import time

import ray

address, want = sys.argv[1], int(sys.argv[2])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while len(alive := [n for n in ray.nodes() if n["Alive"]]) < want:
    time.sleep(1)
cpus = sum(n["Resources"].get("CPU", 0) for n in alive)
gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
print(f"{len(alive)} of {want} nodes joined ({cpus:g} CPUs, {gpus:g} GPUs): "
      + " ".join(sorted(n["NodeManagerAddress"] for n in alive)), flush=True)
ray.shutdown()
EOF
  waiter=$!
  while kill -0 "$waiter" 2>/dev/null; do
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        _rc_err "process $pid (the Ray head or a worker's srun) ended before all $want nodes joined"
        rc=1
      fi
    done
    if [ "$rc" -eq 0 ] && [ $SECONDS -ge $deadline ]; then
      _rc_err "not all $want nodes joined within $timeout s; see the ray-*.log files"
      rc=1
    fi
    if [ "$rc" -ne 0 ]; then
      kill -KILL "$waiter" 2>/dev/null
      wait "$waiter" 2>/dev/null
      return 1
    fi
    sleep 1
  done
  wait "$waiter"
}

# Start the head in the background (_RC_HEAD_PID); succeed once it is up, fail when it ends or time runs out.
_rc_start_head() {
  local ip=$1 port=$2 client_port=$3 agent_port=$4 cpus=$5 gpus=$6 deadline=$7
  rm -rf "/tmp/ray-$SLURM_JOB_ID"
  # shellcheck disable=SC2046
  _rc_ray start --head --port="$port" --ray-client-server-port="$client_port" --include-dashboard=false \
    $(_rc_start_args "$cpus" "$gpus" "$ip" "$agent_port") >>"$RAY_CLUSTER_LOG_DIR/ray-head.log" 2>&1 &
  _RC_HEAD_PID=$!
  until [ -s "/tmp/ray-$SLURM_JOB_ID/ray_current_cluster" ]; do
    kill -0 "$_RC_HEAD_PID" 2>/dev/null && [ $SECONDS -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

# Every process of the job reads the token through the environment: srun passes it to the workers, and the
# recipe inherits it from this shell.
_rc_auth() {
  [ -n "${RAY_AUTH_MODE:-}" ] && return 0
  local token_file="$RAY_CLUSTER_LOG_DIR/ray_auth_token"
  (umask 077 && _rc_python -c 'import secrets; print(secrets.token_hex(32))' >"$token_file") || return 1
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token_file _RC_TOKEN_FILE=$token_file
  _rc_log "Ray token authentication on (token in $token_file)"
}

ray_cluster_up() {
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    _rc_err "not inside a Slurm job (SLURM_JOB_ID is unset)"
    return 1
  fi
  export RAY_CLUSTER_LOG_DIR=${RAY_CLUSTER_LOG_DIR:-$PWD/ray-$SLURM_JOB_ID}
  mkdir -p "$RAY_CLUSTER_LOG_DIR"
  local wait_s=${RAY_CLUSTER_WAIT_S:-300} here nodes cpus ip port client_port agent_port gpus
  here=${SLURMD_NODENAME:-$(hostname -s)}
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  read -r -a cpus < <(_rc_cpus_per_node)
  gpus=$(_rc_gpus_here)
  read -r ip port client_port agent_port < <(_rc_probe 3) || return 1

  trap ray_cluster_down EXIT
  trap 'ray_cluster_down "${RAY_CLUSTER_TERM_GRACE_S:-3}"; exit 143' TERM
  trap 'ray_cluster_down "${RAY_CLUSTER_TERM_GRACE_S:-3}"; exit 130' INT
  _rc_auth || { _rc_err "cannot write the Ray token to $RAY_CLUSTER_LOG_DIR"; return 1; }

  local head_cpus=${cpus[0]:-1} i attempt
  for i in "${!nodes[@]}"; do [ "${nodes[$i]}" = "$here" ] && head_cpus=${cpus[$i]:-$head_cpus}; done
  local deadline=$((SECONDS + wait_s)) attempts=${RAY_CLUSTER_START_ATTEMPTS:-3}
  for ((attempt = 1; ; attempt++)); do
    _rc_log "head $ip:$port on $here with $head_cpus CPUs, $gpus GPUs; ${#nodes[@]} nodes: ${nodes[*]}"
    _rc_start_head "$ip" "$port" "$client_port" "$agent_port" "$head_cpus" "$gpus" "$deadline" && break
    _rc_stop "$_RC_HEAD_PID" 10
    _rc_kill_leftovers
    if [ "$attempt" -ge "$attempts" ] || [ $SECONDS -ge $deadline ]; then
      _rc_err "the Ray head did not start ($attempt attempts); end of $RAY_CLUSTER_LOG_DIR/ray-head.log:"
      tail -n 20 "$RAY_CLUSTER_LOG_DIR/ray-head.log" >&2
      _rc_save_logs
      _RC_HEAD_PID=
      return 1
    fi
    # Ray gives its raylet a fixed 30 s to register; a busy node can miss that, so start afresh.
    _rc_log "the Ray head did not start (attempt $attempt of $attempts); retrying on new ports"
    read -r ip port client_port agent_port < <(_rc_probe 3) || return 1
  done
  export RAY_ADDRESS=$ip:$port

  _RC_WORKER_PIDS=()
  local gres=()
  [ "$gpus" -gt 0 ] && gres=(--gres="gpu:$gpus")
  for i in "${!nodes[@]}"; do
    [ "${nodes[$i]}" = "$here" ] && continue
    srun --overlap --nodes=1 --ntasks=1 --nodelist="${nodes[$i]}" "${gres[@]}" --kill-on-bad-exit=0 \
      bash -c "source '$_RC_LIB'; _ray_cluster_worker '$RAY_ADDRESS' '${cpus[$i]:-1}'" \
      >"$RAY_CLUSTER_LOG_DIR/ray-worker-${nodes[$i]}.log" 2>&1 &
    _RC_WORKER_PIDS+=($!)
  done
  if ! _rc_wait_nodes "${#nodes[@]}" $((deadline - SECONDS > 30 ? deadline - SECONDS : 30)) \
    "$_RC_HEAD_PID" "${_RC_WORKER_PIDS[@]}"; then
    _rc_err "the Ray cluster is incomplete"
    return 1
  fi
  _rc_log "RAY_ADDRESS=$RAY_ADDRESS"
}

# Stop the workers, then the head, giving each $1 seconds (default 30) to drain; a signal-triggered teardown
# passes a short grace, because Slurm kills everything KillWait seconds after its SIGTERM.
ray_cluster_down() {
  [ -n "${_RC_TOKEN_FILE:-}" ] && rm -f "$_RC_TOKEN_FILE"  # the running processes hold the token already
  [ -n "${_RC_HEAD_PID:-}" ] || return 0
  local grace=${1:-30}
  _rc_log "stopping the Ray cluster"
  local pid
  for pid in "${_RC_WORKER_PIDS[@]}"; do _rc_stop "$pid" $((grace + 5)); done
  _rc_stop "$_RC_HEAD_PID" "$grace"
  _rc_save_logs
  _RC_HEAD_PID=
  _RC_WORKER_PIDS=()
}
