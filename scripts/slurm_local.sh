#!/usr/bin/env bash
# A one-host Slurm cluster on this machine (munged, slurmctld and slurmd started directly, no
# systemd), and scripts/slurm.sbatch run through it on CPU with gloo: a job that trains
# undisturbed (the reference losses), a job whose rank 1 is SIGKILLed mid-run (torchrun restarts
# the ranks, they resume from the newest checkpoint), and a job that `scontrol requeue` stops
# mid-run (it runs again under the same id and resumes in the same folder). Both disturbed jobs
# must end with exit 0 and the reference's losses, step for step.
#
#   scripts/slurm_local.sh           # set up (or reuse) the cluster, then run the three jobs
#   scripts/slurm_local.sh setup     # only install, configure and start the daemons
#   scripts/slurm_local.sh stop      # stop slurmd and slurmctld (munged, shared by the host, stays)
#
# Run as root from anywhere; re-running reuses the install, the config and running daemons.
# Everything Slurm writes lives under $LOCAL (state, logs, spool, the jobs' folders). The
# clients find the config through SLURM_CONF; nothing under /etc/slurm is touched.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCAL=${LOCAL:-/tmp/fivecut-slurm}    # the folder this script owns
VENV=${VENV:-$REPO/.venv}             # where torchrun and fivecut's dependencies are installed
PORT=${PORT:-29613}                   # the jobs' rendezvous port
STEPS=${STEPS:-120}                   # training steps of each job (tiny runs ~10 steps/s here)
SAVE_EVERY=${SAVE_EVERY:-10}          # checkpoint.every
KILL_AT=${KILL_AT:-55}                # the disturbed jobs are hit once rank 0 has logged this step
NODE=$(hostname -s)
export SLURM_CONF=$LOCAL/etc/slurm.conf

step() { printf '\n== slurm_local: %s\n' "$*"; }
fail() {
  printf 'slurm_local: %s\n' "$1" >&2
  exit "${2:-1}"
}

# Wait up to $1 seconds for the command after it to succeed.
wait_for() {
  local limit=$1 t=0
  shift
  until "$@" >/dev/null 2>&1; do
    ((t++ < limit)) || return 1
    sleep 1
  done
}

# The daemon $1 did not come up (or did not stay up): name it, quote its log's last error and
# last lines, and stop.
daemon_failed() {
  local name=$1 log=$2
  printf 'slurm_local: %s did not start; its last error (%s):\n    %s\nthe end of that log:\n' \
    "$name" "$log" "$(grep -hE 'error|fatal' "$log" 2>/dev/null | tail -n 1)" >&2
  tail -n 6 "$log" 2>/dev/null | sed 's/^/    /' >&2 || true
  exit 1
}

# ---------------------------------------------------------------- install and configure

install() {
  step "install slurm-wlm and munge from Debian's packages"
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    echo "already installed: $(slurmctld -V)"
    return
  fi
  [[ $(id -u) == 0 ]] || fail "installing Slurm needs root (apt-get); run as root"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
  echo "installed: $(slurmctld -V)"
}

# RealMemory in MB: a little under MemTotal, since slurmd drains a node that has less than it says.
real_memory() {
  awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.95 }' /proc/meminfo
}

write_config() {
  step "write $SLURM_CONF (node $NODE, $(nproc) CPUs, $(real_memory) MB)"
  mkdir -p "$LOCAL"/{etc,state/ctld,state/d,run,log,jobs}
  local new=$SLURM_CONF.new
  cat >"$new" <<EOF
# Written by scripts/slurm_local.sh: one host is the controller and the only node.
ClusterName=fivecut-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$LOCAL/state/ctld
SlurmdSpoolDir=$LOCAL/state/d
SlurmctldPidFile=$LOCAL/run/slurmctld.pid
SlurmdPidFile=$LOCAL/run/slurmd.pid
SlurmctldLogFile=$LOCAL/log/slurmctld.log
SlurmdLogFile=$LOCAL/log/slurmd.log
# No cgroups: processes are tracked through their parent ids, and tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# A restarted slurmd returns its node to service; finished jobs stay visible for 10 minutes.
ReturnToService=2
MinJobAge=600
KillWait=30
# Take the node as configured here even where the sandbox reports its hardware differently.
SlurmdParameters=config_overrides
NodeName=$NODE CPUs=$(nproc) RealMemory=$(real_memory) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$new" "$SLURM_CONF"; then
    rm "$new"
    echo "unchanged"
    return
  fi
  mv "$new" "$SLURM_CONF"
  echo "written; daemons started with an older config are restarted"
  stop_daemons
}

# ---------------------------------------------------------------- daemons

start_munge() {
  step "munged (authentication)"
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    echo "running: a credential encodes and decodes"
    return
  fi
  [[ -s /etc/munge/munge.key ]] || fail "munged: /etc/munge/munge.key is missing or empty; reinstall munge (it makes the key)"
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged || daemon_failed munged /var/log/munge/munged.log
  wait_for 10 sh -c 'munge -n | unmunge' || daemon_failed munged /var/log/munge/munged.log
  echo "started"
}

start_slurmctld() {
  step "slurmctld (controller) on $NODE"
  local pid=$LOCAL/run/slurmctld.pid log=$LOCAL/log/slurmctld.log
  if pid_alive "$pid" && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    echo "running (pid $(cat "$pid")): $(scontrol ping | head -n 1)"
    return
  fi
  slurmctld -f "$SLURM_CONF" || daemon_failed slurmctld "$log"
  # the daemon forks away and may fail after that (a port taken): wait, then look for its pid
  sleep 2
  wait_for 20 sh -c "kill -0 \$(cat $pid) && scontrol ping | grep -q 'is UP'" || daemon_failed slurmctld "$log"
  echo "started (pid $(cat "$pid")): $(scontrol ping | head -n 1)"
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null; }

start_slurmd() {
  step "slurmd (node daemon) on $NODE"
  local pid=$LOCAL/run/slurmd.pid log=$LOCAL/log/slurmd.log
  if pid_alive "$pid"; then
    echo "running (pid $(cat "$pid"))"
  else
    slurmd -f "$SLURM_CONF" || daemon_failed slurmd "$log"
    sleep 2 # as for slurmctld: a failure after the fork shows as a missing process
  fi
  wait_for 30 sh -c "sinfo -h -n $NODE -o %T | grep -Eq '^(idle|mixed|allocated)'" || {
    printf 'slurm_local: node %s is %s: %s\n' "$NODE" "$(node_state)" "$(sinfo -h -R -o %E)" >&2
    daemon_failed slurmd "$log"
  }
  pid_alive "$pid" || daemon_failed slurmd "$log"
  echo "up (pid $(cat "$pid"))"
  sinfo
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemons() {
  local name pid
  for name in slurmd slurmctld; do
    if pid_alive "$LOCAL/run/$name.pid"; then
      pid=$(cat "$LOCAL/run/$name.pid")
      echo "stopping $name (pid $pid)"
      kill "$pid"
      wait_for 20 sh -c "! kill -0 $pid" || fail "$name (pid $pid) did not stop on SIGTERM"
    fi
  done
}

setup() {
  install
  write_config
  start_munge
  start_slurmctld
  start_slurmd
}

# ---------------------------------------------------------------- the jobs

# sbatch scripts/slurm.sbatch as a one-node, 2-rank CPU job named $1; prints the job id.
submit() {
  local name=$1
  (
    cd "$REPO"
    SHARED=$LOCAL/jobs/$name CONFIG=configs/shakespeare.toml GPUS_PER_NODE=2 SAVE_EVERY=$SAVE_EVERY \
      PORT=$PORT VENV=$VENV PYTHONPATH=$REPO \
      sbatch --parsable --job-name "fivecut-$name" --nodes 1 --cpus-per-task "$(nproc)" \
      --gpus-per-node 0 --time 00:20:00 --output "$LOCAL/jobs/%x-%j.out" \
      scripts/slurm.sbatch \
      --set model.preset=tiny --set data.tokenizer=byte --set parallel.dp=2 \
      --set train.steps="$STEPS" --set train.seq_len=64 --set train.global_batch=8 \
      --set train.warmup=2 --set train.eval_every=0 --set log.log_every=10 --set log.plot=false
  )
}

job_field() { scontrol show job -o "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

# Wait until job $1 has ended (a requeued job passes through PENDING again); says how; fails unless COMPLETED.
wait_job() {
  local state
  while :; do
    state=$(job_field "$1" JobState)
    case $state in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED) break ;;
    esac
    sleep 2
  done
  echo "job $1 $state, exit code $(job_field "$1" ExitCode)" >&2
  [[ $state == COMPLETED ]]
}

metrics() { echo "$LOCAL/jobs/$1/run-$2/log/metrics.jsonl"; }

# Until rank 0 of job $2 (named $1) has logged step $3 (a line of metrics.jsonl starts {"step": N,).
wait_step() {
  local file
  file=$(metrics "$1" "$2")
  until grep -qs "^{\"step\": $3," "$file"; do
    [[ $(job_field "$2" JobState) =~ ^(PENDING|RUNNING|CONFIGURING|REQUEUED)$ ]] ||
      fail "job $2 ended before step $3; see $LOCAL/jobs/fivecut-$1-$2.out"
    sleep 0.2
  done
}

# Job $2 (named $1) resumed from a checkpoint, rather than finishing before it was hit.
resumed() {
  grep -h "resumed at step" "$LOCAL/jobs/fivecut-$1-$2.out" ||
    fail "job $2 did not resume from a checkpoint (was it hit after its last step?); lower KILL_AT"
}

# The pid of the training process with RANK=$2 in job $1 (torchrun's child, under slurmstepd).
rank_pid() {
  local pid environ
  for pid in $(pgrep -f 'fivecut train'); do
    environ=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null) || continue
    grep -qx "SLURM_JOB_ID=$1" <<<"$environ" && grep -qx "RANK=$2" <<<"$environ" && { echo "$pid"; return; }
  done
  return 1
}

# The losses of metrics file $2 equal those of $1, step for step (the last record of a repeated step).
same_losses() {
  "$VENV/bin/python" - "$1" "$2" <<'EOF'
import json, sys

def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}

reference, got = losses(sys.argv[1]), losses(sys.argv[2])
differ = [s for s in reference if got.get(s) != reference[s]]
print(f"{len(reference)} steps logged, final loss {reference[max(reference)]:.6f}; "
      f"{len(differ)} differ from the reference" + (f": steps {differ}" if differ else ""))
sys.exit(1 if differ or got.keys() != reference.keys() else 0)
EOF
}

show_output() { sed 's/^/    | /' "$LOCAL/jobs/fivecut-$1-$2.out"; }

run_jobs() {
  rm -rf "${LOCAL:?}"/jobs/*
  step "job 1: the reference, undisturbed"
  local ref killed requeued victim
  ref=$(submit reference)
  echo "submitted job $ref"
  wait_job "$ref" || { show_output reference "$ref"; fail "the reference job failed"; }
  show_output reference "$ref"

  step "job 2: rank 1 is SIGKILLed after step $KILL_AT; torchrun restarts the ranks"
  killed=$(submit killed)
  echo "submitted job $killed"
  wait_step killed "$killed" "$KILL_AT"
  victim=$(rank_pid "$killed" 1) || fail "no process with RANK=1 in job $killed"
  echo "kill -9 $victim (rank 1 of job $killed)"
  kill -9 "$victim"
  wait_job "$killed" || { show_output killed "$killed"; fail "job $killed did not complete after the kill"; }
  show_output killed "$killed"
  resumed killed "$killed"
  same_losses "$(metrics reference "$ref")" "$(metrics killed "$killed")" || fail "job $killed's losses differ"

  step "job 3: scontrol requeue after step $KILL_AT; the job runs again under the same id"
  requeued=$(submit requeued)
  echo "submitted job $requeued"
  wait_step requeued "$requeued" "$KILL_AT"
  echo "scontrol requeue $requeued"
  scontrol requeue "$requeued"
  # Slurm holds a requeued batch job back (its begin time about two minutes on); once it is
  # pending again, let it start now.
  wait_for 120 sh -c "scontrol show job $requeued | grep -q 'JobState=PENDING'" ||
    fail "job $requeued did not return to PENDING after the requeue"
  scontrol update jobid="$requeued" StartTime=now
  wait_job "$requeued" || { show_output requeued "$requeued"; fail "job $requeued did not complete after requeue"; }
  show_output requeued "$requeued"
  [[ $(job_field "$requeued" Restarts) == 1 ]] || fail "job $requeued ran $(job_field "$requeued" Restarts) times again, not once"
  resumed requeued "$requeued"
  same_losses "$(metrics reference "$ref")" "$(metrics requeued "$requeued")" || fail "job $requeued's losses differ"
  step "done: both disturbed jobs ended with exit 0 and the reference's losses"
}

case ${1:-all} in
  setup) setup ;;
  stop) stop_daemons ;;
  all)
    setup
    run_jobs
    ;;
  *) fail "unknown command '$1'; give setup, stop, or nothing (setup, then the three jobs)" 2 ;;
esac
