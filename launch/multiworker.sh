#!/usr/bin/env bash
# multiworker.sh: start and supervise the processes of one tfllm DTensor multi-client job.
#
# DTensor's multi-client runtime needs, in every process, the list of all clients'
# host:port (DTENSOR_JOBS, whose length is the client count), this process's index in it
# (DTENSOR_CLIENT_ID) and a job name (DTENSOR_JOB_NAME). This script derives them from the
# cluster (SLURM, a hostfile, Kubernetes/MPI variables or plain local processes), starts the
# workers in their own process groups and stops all of them when one fails, because a
# DTensor job cannot continue with a client missing: the others would block in a collective.
# Run it with --help for the options and exit codes.
set -euo pipefail

PROG=multiworker.sh
readonly EXIT_USAGE=2 EXIT_STARTUP_TIMEOUT=124 EXIT_PREEMPTED=75

usage() {
  cat <<'EOF'
Usage: multiworker.sh --mode MODE [options] -- COMMAND [ARGS...]

Starts one COMMAND (e.g. `tfllm train --config c.yaml --workdir runs/x`) per host, or per
GPU with --per-gpu, with DTensor's multi-client environment set:
  DTENSOR_JOBS=host0:port0,host1:port1,...   one entry per worker (process)
  DTENSOR_CLIENT_ID=<rank>   DTENSOR_JOB_NAME=<--job-name>
  DTENSOR_GPU_USE_NCCL_COMMUNICATION=1       on GPU
  CUDA_VISIBLE_DEVICES=<one GPU>             with --per-gpu
  MULTIWORKER_RANK, MULTIWORKER_WORLD_SIZE, MULTIWORKER_LOCAL_RANK, MULTIWORKER_ATTEMPT
Each worker's output is printed as "[rank N] ..." and saved to LOG_DIR/rank_N.log. If a
worker exits non-zero all are stopped (SIGTERM, SIGKILL after --kill-timeout).

Modes (--mode):
  local     --num-workers N processes on this host (ports: free ones, or --port, --port+1..).
  slurm     inside an allocation, once per srun task (srun ... multiworker.sh --mode slurm):
            rank SLURM_PROCID of SLURM_NTASKS; hosts from SLURM_STEP_NODELIST (else
            SLURM_JOB_NODELIST) and SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE),
            block distribution. This task starts only its own worker.
  hostfile  --hostfile FILE, one host per line (# comments, blank lines ignored); every
            worker is started from here over --ssh. Ranks follow the file order.
  env       the caller gives rank and world size: --rank/--world-size, else
            JOB_COMPLETION_INDEX (Kubernetes Indexed Job) or OMPI_COMM_WORLD_RANK /
            OMPI_COMM_WORLD_SIZE (mpirun); hosts from --hosts or --host-pattern. This
            process starts only its own worker.

Options:
  --mode MODE            local | slurm | hostfile | env (required).
  --num-workers N        local: number of processes (default: one per GPU with --per-gpu).
  --per-gpu              one process per GPU instead of one per host; sets
                         CUDA_VISIBLE_DEVICES to the worker's GPU (the LOCAL_RANK-th entry of
                         an inherited CUDA_VISIBLE_DEVICES list, else LOCAL_RANK).
  --gpus-per-host N      hostfile + --per-gpu: processes per host (default 8).
  --port PORT            first port; a host's workers use PORT, PORT+1, ... (default: free
                         ports in local mode, 9991 otherwise). All hosts must agree.
  --job-name NAME        DTENSOR_JOB_NAME (default worker).
  --device auto|cpu|gpu  gpu sets DTENSOR_GPU_USE_NCCL_COMMUNICATION=1; auto = gpu when
                         --per-gpu is given or nvidia-smi lists a GPU here (default auto).
  --hostfile FILE        hostfile mode: the hosts.
  --ssh COMMAND          hostfile mode: the remote shell (default "ssh -o BatchMode=yes"),
                         run as COMMAND HOST REMOTE_SCRIPT.
  --export NAMES         hostfile mode: comma list of variables passed to remote workers
                         (default PATH,PYTHONPATH,VIRTUAL_ENV,KERAS_BACKEND,
                         TF_CPP_MIN_LOG_LEVEL,XLA_FLAGS plus every TFLLM_* and NCCL_*).
  --rank R               env mode: this process's rank (overrides the environment).
  --world-size N         env mode: the number of processes.
  --hosts H0,H1,...      env mode: one host per rank, or one per node when the world size is
                         a multiple (ranks fill a node's slots in order).
  --host-pattern PAT     env mode: hosts from a pattern, {rank} replaced by 0..N-1, e.g.
                         'tfllm-{rank}.tfllm' (Indexed Job pods behind a headless Service).
  --log-dir DIR          where rank_N.log and pids go (default WORKDIR/logs when the
                         command has --workdir WORKDIR, else ./multiworker-logs).
  --kill-timeout S       seconds between SIGTERM and SIGKILL when stopping (default 15).
  --startup-timeout S    fail if no worker is ready within S seconds (default 900; 0: never).
  --ready-pattern REGEX  (extended regex) a worker is ready when an output line matches it
                         (default 'on mesh \['). Building a multi-client mesh needs every
                         client, so one ready worker means that all have joined.
  --max-restarts N       after a failure or startup timeout, stop everything and start all
                         workers again, up to N times (default 0). `tfllm train --workdir`
                         resumes from the latest checkpoint there.
  --dry-run              print each worker's environment and command; start nothing.
  --expand-nodelist LIST print a SLURM nodelist's hostnames, one per line, and exit
                         (scontrol show hostnames, else a built-in expansion).
  -h, --help             this help.

Exit codes:
  0     every worker exited 0
  2     bad arguments or environment (nothing was started)
  124   no worker became ready within --startup-timeout
  75    the workers were stopped by a forwarded signal and at least one exited 75
        (tfllm's proposed "preempted, checkpoint saved, requeue me" code)
  128+N the launcher itself got signal N (SIGINT 130, SIGTERM 143); it forwarded SIGTERM
  other the first failing worker's exit code (128+N when a signal N killed it)

Signals: SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every worker's process
group as SIGTERM (background processes of a script ignore SIGINT), then SIGKILL after
--kill-timeout.
EOF
}

die() {  # die CODE MESSAGE: an error that names the option and the fix
  local code=$1
  shift
  echo "$PROG: error: $*" >&2
  if [[ $code == "$EXIT_USAGE" ]]; then echo "Run '$PROG --help' for the options." >&2; fi
  exit "$code"
}

say() { echo "$PROG: $*" >&2; }

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

python_bin() {
  local p
  for p in "${PYTHON:-}" python3 python; do
    if [[ -n $p ]] && command -v "$p" >/dev/null 2>&1; then echo "$p"; return; fi
  done
  die "$EXIT_USAGE" "no python found (python3 or python, or set PYTHON=/path/to/python)"
}

# ---------------------------------------------------------------- SLURM helpers
expand_nodelist() {  # expand_nodelist 'node[01-04,07],gpu1' -> one hostname per line
  local scontrol=${SCONTROL:-scontrol}
  if command -v "$scontrol" >/dev/null 2>&1; then
    "$scontrol" show hostnames "$1"
    return
  fi
  # No scontrol (tests, laptops): expand the common forms prefix[a-b,c]suffix, nested left
  # to right, keeping each range's zero padding as SLURM does.
  "$(python_bin)" - "$1" <<'PY'
import re, sys

def split_top(text):
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur] if cur else parts

def expand(item):
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    head, ranges, tail = m.groups()
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            sys.exit(f"multiworker.sh: error: cannot expand nodelist range '{r}' in '{item}'")
        for n in range(int(lo), int(hi) + 1):
            out += [head + str(n).zfill(len(lo)) + rest for rest in expand(tail)]
    return out

for item in split_top(sys.argv[1]):
    print("\n".join(expand(item)))
PY
}

expand_tasks_per_node() {  # '2(x3),1' -> 2 2 2 1 (one count per line)
  local part count times
  IFS=',' read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      count=${BASH_REMATCH[1]}
      times=${BASH_REMATCH[2]}
    elif [[ $part =~ ^[0-9]+$ ]]; then
      count=$part
      times=1
    else
      die "$EXIT_USAGE" "cannot parse SLURM tasks per node '$1' (expected e.g. '8(x4)' or '2,1')"
    fi
    for ((i = 0; i < times; i++)); do echo "$count"; done
  done
}

# ---------------------------------------------------------------- arguments
mode="" num_workers="" per_gpu=0 gpus_per_host=8 port="" job_name=worker device=auto
hostfile="" ssh_cmd="ssh -o BatchMode=yes" export_names="" rank="" world_size="" hosts_arg=""
host_pattern="" log_dir="" kill_timeout=15 startup_timeout=900 ready_pattern='on mesh \['
max_restarts=0 dry_run=0
cmd=()

need_value() {  # need_value OPTION REMAINING_ARGC
  if (($2 < 2)); then die "$EXIT_USAGE" "$1 needs a value"; fi
}

while (($#)); do
  arg=$1
  if [[ $arg == --*=* ]]; then  # --opt=value is the same as --opt value
    set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
    arg=$1
  fi
  case $arg in
    -h | --help) usage; exit 0 ;;
    --per-gpu) per_gpu=1; shift; continue ;;
    --dry-run) dry_run=1; shift; continue ;;
    --) shift; cmd=("$@"); break ;;
    --mode | --num-workers | --gpus-per-host | --port | --job-name | --device | --hostfile | \
      --ssh | --export | --rank | --world-size | --hosts | --host-pattern | --log-dir | \
      --kill-timeout | --startup-timeout | --ready-pattern | --max-restarts | --expand-nodelist)
      need_value "$arg" $#
      value=$2
      shift 2
      ;;
    *) die "$EXIT_USAGE" "unknown argument '$arg'; options come before '--', the command after it" ;;
  esac
  case $arg in
    --mode) mode=$value ;;
    --num-workers) num_workers=$value ;;
    --gpus-per-host) gpus_per_host=$value ;;
    --port) port=$value ;;
    --job-name) job_name=$value ;;
    --device) device=$value ;;
    --hostfile) hostfile=$value ;;
    --ssh) ssh_cmd=$value ;;
    --export) export_names=$value ;;
    --rank) rank=$value ;;
    --world-size) world_size=$value ;;
    --hosts) hosts_arg=$value ;;
    --host-pattern) host_pattern=$value ;;
    --log-dir) log_dir=$value ;;
    --kill-timeout) kill_timeout=$value ;;
    --startup-timeout) startup_timeout=$value ;;
    --ready-pattern) ready_pattern=$value ;;
    --max-restarts) max_restarts=$value ;;
    --expand-nodelist) expand_nodelist "$value"; exit 0 ;;
  esac
done

case $mode in
  local | slurm | hostfile | env) ;;
  "") die "$EXIT_USAGE" "--mode is required: local, slurm, hostfile or env" ;;
  *) die "$EXIT_USAGE" "--mode '$mode' is unknown; use local, slurm, hostfile or env" ;;
esac
if ((${#cmd[@]} == 0)); then
  die "$EXIT_USAGE" "no command after '--'; e.g. $PROG --mode $mode ... -- tfllm train --config configs/tiny.yaml --workdir runs/x"
fi
for pair in "--kill-timeout:$kill_timeout" "--startup-timeout:$startup_timeout" \
  "--max-restarts:$max_restarts" "--gpus-per-host:$gpus_per_host"; do
  if ! is_uint "${pair#*:}"; then
    die "$EXIT_USAGE" "${pair%%:*} must be a whole number of seconds/times, got '${pair#*:}'"
  fi
done
if ((gpus_per_host < 1)); then die "$EXIT_USAGE" "--gpus-per-host must be at least 1"; fi
if [[ -n $port ]] && ! { is_uint "$port" && ((port >= 1 && port <= 65535)); }; then
  die "$EXIT_USAGE" "--port must be a TCP port number (1-65535), got '$port'"
fi
case $device in
  auto | cpu | gpu) ;;
  *) die "$EXIT_USAGE" "--device '$device' is unknown; use auto, cpu or gpu" ;;
esac
if [[ $device == auto ]]; then
  device=cpu
  if ((per_gpu)) || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    device=gpu
  fi
fi
pattern_rc=0
grep -Eq -- "$ready_pattern" </dev/null 2>/dev/null || pattern_rc=$?
if ((pattern_rc == 2)); then
  die "$EXIT_USAGE" "--ready-pattern '$ready_pattern' is not a valid extended regex"
fi

# ---------------------------------------------------------------- ranks and hosts
# rank_hosts[r] is rank r's host; own_ranks are the ranks this launcher starts.
rank_hosts=()
own_ranks=()

case $mode in
  local)
    if [[ -z $num_workers ]]; then
      if ((per_gpu)) && command -v nvidia-smi >/dev/null 2>&1; then
        num_workers=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
      fi
      if [[ -z $num_workers || $num_workers == 0 ]]; then
        die "$EXIT_USAGE" "--num-workers is required in local mode (no GPUs found to count with --per-gpu)"
      fi
    fi
    if ! is_uint "$num_workers" || ((num_workers < 1)); then
      die "$EXIT_USAGE" "--num-workers must be at least 1, got '$num_workers'"
    fi
    for ((r = 0; r < num_workers; r++)); do rank_hosts+=(localhost); own_ranks+=("$r"); done
    ;;
  slurm)
    for var in SLURM_PROCID SLURM_NTASKS; do
      if [[ -z ${!var:-} ]]; then
        die "$EXIT_USAGE" "--mode slurm: $var is not set; run this script under srun inside an allocation (srun $PROG --mode slurm -- ...), or use --mode local/env"
      fi
    done
    nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}
    if [[ -z $nodelist ]]; then
      die "$EXIT_USAGE" "--mode slurm: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; run under srun"
    fi
    mapfile -t nodes < <(expand_nodelist "$nodelist")
    tasks_per_node=${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}
    if [[ -n $tasks_per_node ]]; then
      mapfile -t counts < <(expand_tasks_per_node "$tasks_per_node")
    else
      counts=()
      for _ in "${nodes[@]}"; do counts+=($((SLURM_NTASKS / ${#nodes[@]}))); done
    fi
    if ((${#counts[@]} != ${#nodes[@]})); then
      die "$EXIT_USAGE" "--mode slurm: ${#nodes[@]} nodes ($nodelist) but tasks per node '$tasks_per_node' has ${#counts[@]} entries"
    fi
    for i in "${!nodes[@]}"; do
      for ((t = 0; t < counts[i]; t++)); do rank_hosts+=("${nodes[i]}"); done
    done
    if ((${#rank_hosts[@]} != SLURM_NTASKS)); then
      die "$EXIT_USAGE" "--mode slurm: the tasks per node add up to ${#rank_hosts[@]}, not SLURM_NTASKS=$SLURM_NTASKS; use srun's default block distribution"
    fi
    own_ranks=("$SLURM_PROCID")
    ;;
  hostfile)
    if [[ -z $hostfile ]]; then die "$EXIT_USAGE" "--mode hostfile needs --hostfile FILE (one host per line)"; fi
    if [[ ! -r $hostfile ]]; then die "$EXIT_USAGE" "--hostfile '$hostfile' does not exist or is not readable"; fi
    while IFS= read -r line || [[ -n $line ]]; do
      line=${line%%#*}
      read -r host _ <<<"$line" || true
      if [[ -z ${host:-} ]]; then continue; fi
      slots=1
      if ((per_gpu)); then slots=$gpus_per_host; fi
      for ((t = 0; t < slots; t++)); do rank_hosts+=("$host"); done
    done <"$hostfile"
    if ((${#rank_hosts[@]} == 0)); then die "$EXIT_USAGE" "--hostfile '$hostfile' lists no hosts"; fi
    for r in "${!rank_hosts[@]}"; do own_ranks+=("$r"); done
    ;;
  env)
    rank=${rank:-${JOB_COMPLETION_INDEX:-${OMPI_COMM_WORLD_RANK:-}}}
    world_size=${world_size:-${OMPI_COMM_WORLD_SIZE:-}}
    if [[ -z $rank ]]; then
      die "$EXIT_USAGE" "--mode env: no rank; give --rank, or set JOB_COMPLETION_INDEX (Kubernetes Indexed Job) or OMPI_COMM_WORLD_RANK (mpirun)"
    fi
    if [[ -z $world_size ]]; then
      die "$EXIT_USAGE" "--mode env: no world size; give --world-size (e.g. the Job's completions) or set OMPI_COMM_WORLD_SIZE"
    fi
    if ! is_uint "$world_size" || ((world_size < 1)); then
      die "$EXIT_USAGE" "--world-size must be at least 1, got '$world_size'"
    fi
    if ! is_uint "$rank" || ((rank >= world_size)); then
      die "$EXIT_USAGE" "--rank must be in 0..$((world_size - 1)), got '$rank'"
    fi
    if [[ -n $hosts_arg && -n $host_pattern ]]; then
      die "$EXIT_USAGE" "give --hosts or --host-pattern, not both"
    elif [[ -n $host_pattern ]]; then
      hosts=()
      for ((r = 0; r < world_size; r++)); do hosts+=("${host_pattern//\{rank\}/$r}"); done
    elif [[ -n $hosts_arg ]]; then
      IFS=',' read -ra hosts <<<"$hosts_arg"
    else
      die "$EXIT_USAGE" "--mode env needs the hosts: --hosts h0,h1,... or --host-pattern 'name-{rank}.service'"
    fi
    if ((world_size % ${#hosts[@]})); then
      die "$EXIT_USAGE" "--hosts has ${#hosts[@]} entries; give one per rank ($world_size) or one per node (a divisor of $world_size)"
    fi
    per_node=$((world_size / ${#hosts[@]}))
    for h in "${hosts[@]}"; do
      for ((t = 0; t < per_node; t++)); do rank_hosts+=("$h"); done
    done
    own_ranks=("$rank")
    ;;
esac
world=${#rank_hosts[@]}

# local_index[r]: r's slot on its host (its port offset and, per GPU, its GPU).
local_index=()
declare -A seen_on_host=()
for r in "${!rank_hosts[@]}"; do
  h=${rank_hosts[r]}
  local_index[r]=${seen_on_host[$h]:-0}
  seen_on_host[$h]=$((local_index[r] + 1))
done

free_ports() {  # free_ports N: N distinct free TCP ports on this host
  "$(python_bin)" - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

check_port_free() {  # check_port_free PORT: exit 2 when something listens on it here
  if ! "$(python_bin)" - "$1" <<'PY' 2>/dev/null; then
import socket, sys
s = socket.socket()
s.bind(("", int(sys.argv[1])))
PY
    die "$EXIT_USAGE" "port $1 is in use on $(hostname); choose another --port$([[ $mode == local ]] && echo ' or omit it to pick free ports')"
  fi
}

ports=()
assign_ports() {
  local r
  ports=()
  if [[ $mode == local && -z $port ]]; then
    read -ra ports <<<"$(free_ports "$world")"
    return
  fi
  for r in "${!rank_hosts[@]}"; do ports[r]=$((${port:-9991} + local_index[r])); done
  if ((ports[world - 1] > 65535)); then die "$EXIT_USAGE" "--port ${port:-9991} + workers per host exceeds 65535"; fi
  if [[ $mode != hostfile ]]; then  # hostfile ports are on other hosts
    for r in "${own_ranks[@]}"; do check_port_free "${ports[r]}"; done
  fi
}

# The command's --workdir: tfllm's clients other than 0 log there, and it is the default
# home of our logs (--log-dir, else WORKDIR/logs).
workdir=""
for ((i = 0; i < ${#cmd[@]}; i++)); do
  if [[ ${cmd[i]} == --workdir && $((i + 1)) -lt ${#cmd[@]} ]]; then workdir=${cmd[i + 1]}; fi
  if [[ ${cmd[i]} == --workdir=* ]]; then workdir=${cmd[i]#--workdir=}; fi
done
if [[ -z $log_dir ]]; then
  log_dir=multiworker-logs
  if [[ -n $workdir ]]; then log_dir=$workdir/logs; fi
fi

# ---------------------------------------------------------------- per-worker environment
worker_env() {  # worker_env RANK: prints NAME=VALUE lines
  local r=$1 jobs="" i gpu
  for ((i = 0; i < world; i++)); do jobs+="${jobs:+,}${rank_hosts[i]}:${ports[i]}"; done
  echo "DTENSOR_JOBS=$jobs"
  echo "DTENSOR_CLIENT_ID=$r"
  echo "DTENSOR_JOB_NAME=$job_name"
  echo "MULTIWORKER_RANK=$r"
  echo "MULTIWORKER_WORLD_SIZE=$world"
  echo "MULTIWORKER_LOCAL_RANK=${local_index[r]}"
  echo "MULTIWORKER_ATTEMPT=$attempt"
  if [[ $device == gpu ]]; then echo "DTENSOR_GPU_USE_NCCL_COMMUNICATION=1"; fi
  if ((per_gpu)); then
    gpu=${local_index[r]}
    if [[ $mode != hostfile && -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
      # SLURM/Kubernetes may already have bound GPUs: pick from what this process may see.
      IFS=',' read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
      if ((${#visible[@]} == 1)); then gpu=${visible[0]}; else gpu=${visible[local_index[r]]:-$gpu}; fi
    fi
    echo "CUDA_VISIBLE_DEVICES=$gpu"
  fi
}

remote_script() {  # remote_script RANK: the shell script a remote host runs for RANK
  local r=$1 assignments="" name line
  local -a names=()
  IFS=',' read -ra names <<<"${export_names:-PATH,PYTHONPATH,VIRTUAL_ENV,KERAS_BACKEND,TF_CPP_MIN_LOG_LEVEL,XLA_FLAGS}"
  if [[ -z $export_names ]]; then
    while IFS= read -r name; do names+=("$name"); done < <(compgen -e | grep -E '^(TFLLM|NCCL)_' || true)
  fi
  for name in "${names[@]}"; do
    if [[ -n ${!name+x} ]]; then assignments+=" $(printf '%q' "$name=${!name}")"; fi
  done
  while IFS= read -r line; do assignments+=" $(printf '%q' "$line")"; done < <(worker_env "$r")
  # ssh without a tty does not signal the remote command when the connection drops: the
  # watcher kills the worker when our end of stdin closes (the local ssh was stopped).
  printf 'cd %q || exit 2; exec 3<&0; env%s' "$PWD" "$assignments"
  printf ' %q' "${cmd[@]}"
  # shellcheck disable=SC2016  # expanded by the remote shell
  printf ' </dev/null 3<&- & p=$!; { read -r _ <&3; kill -TERM $p 2>/dev/null; } & w=$!; '
  # shellcheck disable=SC2016
  printf 'wait $p; rc=$?; kill $w 2>/dev/null; exit $rc\n'
}

attempt=0
assign_ports  # here too, so that a port in use fails before anything starts
if ((dry_run)); then
  echo "mode=$mode world_size=$world device=$device log_dir=$log_dir"
  for r in "${own_ranks[@]}"; do
    echo "rank $r host ${rank_hosts[r]} port ${ports[r]}"
    worker_env "$r" | sed 's/^/  /'
    if [[ $mode == hostfile ]]; then
      printf '  exec: %s %q %q\n' "$ssh_cmd" "${rank_hosts[r]}" "$(remote_script "$r")"
    else
      printf '  exec:'
      printf ' %q' "${cmd[@]}"
      printf '\n'
    fi
  done
  exit 0
fi

if ! mkdir -p "$log_dir" 2>/dev/null; then
  die "$EXIT_USAGE" "cannot create the log directory '$log_dir'; give a writable --log-dir"
fi
log_dir=$(cd "$log_dir" && pwd)
tmp_dir=$(mktemp -d "${TMPDIR:-/tmp}/multiworker.XXXXXX")

# ---------------------------------------------------------------- start, watch, stop
declare -A pids=() readers=() exit_codes=() client_log_offset=()
got_signal=0

spawn_group() {  # runs "$@" as the leader of a new process group (so we can stop its tree)
  if command -v setsid >/dev/null 2>&1; then
    exec setsid "$@"
  fi
  exec "$(python_bin)" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}

start_worker() {
  local r=$1 fifo="$tmp_dir/rank_$1.fifo" log="$log_dir/rank_$1.log" client_log
  local -a env_lines=()
  rm -f "$fifo" "$log_dir/ready.$r"
  mkfifo "$fifo"
  echo "=== $PROG: rank $r attempt $attempt started $(date -u +%FT%TZ) ===" >>"$log"
  # The reader prefixes lines for our stdout, appends them raw to the rank's log and marks
  # the worker ready on the first line matching --ready-pattern. It ignores INT/TERM so
  # that it prints the workers' last words while they shut down.
  (
    trap '' INT TERM HUP
    ready=0
    # A bash loop rather than awk: mawk reads a pipe in blocks, which would delay both
    # the output and the ready mark until a buffer fills.
    while IFS= read -r line || [[ -n $line ]]; do
      printf '%s\n' "$line" >&3
      printf '[rank %s] %s\n' "$r" "$line"
      if ((!ready)) && [[ $line =~ $ready_pattern ]]; then
        ready=1
        : >"$log_dir/ready.$r"
      fi
    done 3>>"$log"
  ) <"$fifo" &
  readers[$r]=$!
  # tfllm's clients other than 0 print to WORKDIR/logs/client_N.log rather than stdout:
  # only what is written there from now on counts as this attempt's ready line.
  client_log=${workdir:+$workdir/logs/client_$r.log}
  client_log_offset[$r]=0
  if [[ -n $client_log && -f $client_log ]]; then client_log_offset[$r]=$(wc -c <"$client_log"); fi
  mapfile -t env_lines < <(worker_env "$r")
  if [[ $mode == hostfile ]]; then
    local -a ssh_words
    read -ra ssh_words <<<"$ssh_cmd"
    # The sleep holds ssh's stdin open; when we stop this group, the remote watcher sees EOF.
    # shellcheck disable=SC2016  # expanded by the inner bash
    (spawn_group bash -c '"$@" < <(exec sleep 2147483647); rc=$?; kill $! 2>/dev/null; exit $rc' \
      _ "${ssh_words[@]}" "${rank_hosts[r]}" \
      "$(remote_script "$r")") >"$fifo" 2>&1 </dev/null &
  else
    (spawn_group env "${env_lines[@]}" "${cmd[@]}") >"$fifo" 2>&1 </dev/null &
  fi
  pids[$r]=$!
  echo "$r ${pids[$r]}" >>"$log_dir/pids"
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

stop_all() {  # SIGTERM every worker's process group; SIGKILL what is left after --kill-timeout
  local r deadline any
  for r in "${!pids[@]}"; do
    if group_alive "${pids[$r]}"; then kill -TERM -- "-${pids[$r]}" 2>/dev/null || true; fi
  done
  deadline=$((SECONDS + kill_timeout))
  while ((SECONDS < deadline)); do
    any=0
    for r in "${!pids[@]}"; do if group_alive "${pids[$r]}"; then any=1; fi; done
    if ((!any)); then break; fi
    sleep 0.2
  done
  for r in "${!pids[@]}"; do
    if group_alive "${pids[$r]}"; then
      say "rank $r did not stop within --kill-timeout $kill_timeout s; sending SIGKILL"
      kill -KILL -- "-${pids[$r]}" 2>/dev/null || true
    fi
  done
  reap_all
}

reap_all() {  # collects exit codes and waits for the output readers to drain
  local r rc
  for r in "${!pids[@]}"; do
    if [[ -z ${exit_codes[$r]:-} ]]; then
      rc=0
      wait "${pids[$r]}" 2>/dev/null || rc=$?
      exit_codes[$r]=$rc
    fi
  done
  for r in "${!readers[@]}"; do wait "${readers[$r]}" 2>/dev/null || true; done
}

is_ready() {
  local r client_log
  for r in "${own_ranks[@]}"; do
    if [[ -e $log_dir/ready.$r ]]; then return 0; fi
    client_log=${workdir:+$workdir/logs/client_$r.log}
    if [[ -n $client_log && -f $client_log ]] &&
      tail -c "+$((client_log_offset[$r] + 1))" "$client_log" | grep -Eq -- "$ready_pattern"; then
      return 0
    fi
  done
  return 1
}

on_signal() {
  got_signal=$1
}

cleanup() {
  local r
  for r in "${!pids[@]}"; do
    if group_alive "${pids[$r]}"; then kill -KILL -- "-${pids[$r]}" 2>/dev/null || true; fi
  done
  rm -rf "${tmp_dir:-}"
}
trap cleanup EXIT
trap 'on_signal 2' INT
trap 'on_signal 15' TERM
trap 'on_signal 1' HUP

# run_attempt: starts the workers and watches them; returns the attempt's exit code.
run_attempt() {
  local r rc started=$SECONDS ready=0
  pids=() readers=() exit_codes=()
  : >"$log_dir/pids"
  assign_ports
  for r in "${own_ranks[@]}"; do start_worker "$r"; done
  say "attempt $attempt: started rank(s) ${own_ranks[*]} of $world; logs in $log_dir"
  while :; do
    if ((got_signal)); then
      say "received signal $got_signal; sending SIGTERM to the workers (SIGKILL after ${kill_timeout} s)"
      stop_all
      for r in "${!exit_codes[@]}"; do
        if [[ ${exit_codes[$r]} == "$EXIT_PREEMPTED" ]]; then return "$EXIT_PREEMPTED"; fi
      done
      return $((128 + got_signal))
    fi
    local alive=0
    for r in "${!pids[@]}"; do
      if [[ -n ${exit_codes[$r]:-} ]]; then continue; fi
      if kill -0 "${pids[$r]}" 2>/dev/null; then alive=1; continue; fi
      rc=0
      wait "${pids[$r]}" 2>/dev/null || rc=$?
      exit_codes[$r]=$rc
      # Whatever the worker left in its process group must not outlive it.
      if group_alive "${pids[$r]}"; then kill -TERM -- "-${pids[$r]}" 2>/dev/null || true; fi
      if ((rc != 0)); then
        say "rank $r exited with code $rc; stopping the other workers (log: $log_dir/rank_$r.log)"
        stop_all
        return "$rc"
      fi
    done
    if ((!alive)); then
      reap_all
      return 0
    fi
    if ((!ready)) && is_ready; then
      ready=1
      say "workers ready after $((SECONDS - started)) s"
    fi
    if ((!ready && startup_timeout > 0 && SECONDS - started >= startup_timeout)); then
      say "error: no worker printed a line matching --ready-pattern '$ready_pattern' within --startup-timeout $startup_timeout s; a worker may be waiting for one that never joined. Check $log_dir/rank_*.log and that every host reaches the DTENSOR_JOBS ports; raise --startup-timeout for slow starts."
      stop_all
      return "$EXIT_STARTUP_TIMEOUT"
    fi
    sleep 0.2
  done
}

while :; do
  code=0
  run_attempt || code=$?
  if ((code == 0)); then
    say "all workers exited 0"
    exit 0
  fi
  if ((got_signal)) || ((attempt >= max_restarts)); then
    say "exiting with code $code"
    exit "$code"
  fi
  attempt=$((attempt + 1))
  say "restarting all workers (restart $attempt of --max-restarts $max_restarts)"
done
