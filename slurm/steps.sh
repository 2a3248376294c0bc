# shellcheck shell=bash
# Sourced by slurm/ddp.sh and slurm/single.sh inside the batch job: runs one torchrun per node with
# `srun`, forwards preemption to it, and requeues the job when it stopped after saving because Slurm
# warned of the time limit (USR1) or preempted it (SIGTERM).
#
# Signals here (the batch shell): USR1, Slurm's warning before the time limit, becomes SIGTERM to
# every job step (scancel); SIGTERM of a preemption goes from Slurm to the steps itself. In each
# step the supervisor passes it to torchrun (trainer/launch/supervisor.py), which passes it to the workers,
# which save and exit 75 (trainer/worker/stop.py).
#
# Environment (all optional):
#   CONFIG=configs/default.yaml   trainer config file (relative to the repository)
#   RUN_NAME=<job name>           stable name of the run: checkpoints go to $CKPT_ROOT/$RUN_NAME, so a
#                                 resubmitted or requeued job resumes (the job id would change)
#   SHARED_DIR=$SLURM_SUBMIT_DIR  a file system every node sees; CKPT_ROOT=$SHARED_DIR/checkpoints
#   DATA_DIR=$SHARED_DIR/data     the data set (CIFAR-10 is downloaded there once if missing)
#   TORCH_HOME=$SHARED_DIR/torch  pretrained weights (model.weights) in hub/checkpoints: downloaded
#                                 there once, or put there by hand where nodes have no network (in
#                                 a container: .torch in the run's checkpoint folder, mounted there)
#   NPROC_PER_NODE=<GPUs on node> processes per node (set it for CPU-only nodes)
#   MAX_RESTARTS=3                torchrun restarts of the whole group after a failure
#   MIN_NODES=$SLURM_NNODES       elastic: fewer nodes the job may go on with (--nnodes MIN_NODES:
#                                 SLURM_NNODES); submit with --no-kill so that the allocation
#                                 outlives a failed node. Every size in the range must split
#                                 train.batch_size. The first node holds the rendezvous (unless
#                                 RDZV_ENDPOINT names an etcd server): the job
#                                 survives the loss of any other node
#   RDZV_PORT=a free port         c10d rendezvous port on the first node (picked there)
#   RDZV_ENDPOINT=HOST:PORT       an etcd server (v2 API: etcd --enable-v2) on a host that is not a
#                                 node of the job: torchrun's etcd-v2 rendezvous, which survives the
#                                 loss of any node, the first included (needs python-etcd: the
#                                 etcd extra). Unset: c10d on the first node
#   LOCAL_ADDR=auto               address each node advertises: auto = this node's source address on
#                                 the route to the first node (the interface the others reach it
#                                 by; `hostname -I` lists addresses in no set order: docker0, IPoIB);
#                                 none = torchrun's default (its hostname, which may not resolve)
#   VENV=$REPO/.venv              Python environment to activate, if present
#   CONTAINER_IMAGE=...           run the step in this image with pyxis (--container-image)
#   APPTAINER_IMAGE=...           or with Apptainer (apptainer exec --nv)

set -euo pipefail

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
CONFIG=${CONFIG:-configs/default.yaml}
RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-cifar}}
SHARED_DIR=${SHARED_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
CKPT_ROOT=${CKPT_ROOT:-$SHARED_DIR/checkpoints}
DATA_DIR=${DATA_DIR:-$SHARED_DIR/data}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
MIN_NODES=${MIN_NODES:-${SLURM_NNODES:-1}}
# A port free on the first node, where this batch script runs: two jobs that share a node never
# share it (a port from the job id would, for ids 1000 apart). Without python3 here, that formula.
# The port is free when picked and bound by the first node's torchrun when the step starts, seconds
# later: a process that takes it in between makes that torchrun fail (a crash exit, which a requeue
# retries with a new pick). Set RDZV_PORT to a port your site keeps free to close the window.
pick_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null \
        || echo $((29500 + ${SLURM_JOB_ID:-0} % 1000))
}
RDZV_PORT=${RDZV_PORT:-$(pick_port)}
LOCAL_ADDR=${LOCAL_ADDR:-auto}

# the first step's record reports the seconds since this moment (the batch job's start)
TRAINER_COMMAND_START=${TRAINER_COMMAND_START:-$(date +%s.%N)}
export TRAINER_COMMAND_START

cd "$REPO"
if [ -z "${CONTAINER_IMAGE:-}${APPTAINER_IMAGE:-}" ] && [ -f "${VENV:-$REPO/.venv}/bin/activate" ]; then
    # shellcheck disable=SC1091
    source "${VENV:-$REPO/.venv}/bin/activate"
fi

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$head_node:$RDZV_PORT")
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    rdzv=(--rdzv-backend=etcd-v2 --rdzv-endpoint="$RDZV_ENDPOINT")
fi
ckpt_dir=$CKPT_ROOT/$RUN_NAME
data_dir=$DATA_DIR
mkdir -p "$ckpt_dir"

container=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then      # pyxis: the container goes on srun, the batch script stays on the host
    container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$ckpt_dir:/checkpoints,$DATA_DIR:/data")
    ckpt_dir=/checkpoints data_dir=/data
fi
# pretrained weights' cache (model.weights): a folder every node sees, that outlives the job
if [ -n "${CONTAINER_IMAGE:-}${APPTAINER_IMAGE:-}" ]; then
    TORCH_HOME=$ckpt_dir/.torch
else
    TORCH_HOME=${TORCH_HOME:-$SHARED_DIR/torch}
fi
export TORCH_HOME

# Each node runs this: torchrun with c10d rendezvous on the first node, the job id as rendezvous id,
# through `trainer torchrun`, which keeps the exit contract (0 done, 75 saved on a signal, 2 bad
# input, else a crash) where a bare torchrun would exit 1 on any signal.
# shellcheck disable=SC2016  # expanded on each node, not here
node_cmd='addr=()
case "$LOCAL_ADDR" in
  none) ;;
  auto)
    head_ip=$(getent hosts "$HEAD_NODE" | awk "{print \$1; exit}")
    # the kernel picks the source address on the route to the first node (a UDP connect sends
    # nothing); Python, not `ip`, which the image lacks when the step runs in it (CONTAINER_IMAGE)
    src=$(python -c "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], 9)); print(s.getsockname()[0])" "$head_ip" 2>/dev/null)
    addr=(--local-addr "${src:-$(hostname -I | cut -d" " -f1)}") ;;
  *) addr=(--local-addr "$LOCAL_ADDR") ;;
esac
echo "$(hostname): rendezvous at ${RDZV_ENDPOINT:-$HEAD_NODE:$RDZV_PORT}, this node advertises ${addr[1]:-its host name}" >&2
if [ -n "$APPTAINER_IMAGE" ]; then
  exec apptainer exec --nv --bind "$APPTAINER_BIND" "$APPTAINER_IMAGE" python -m trainer torchrun "${addr[@]}" "$@"
fi
exec python -m trainer torchrun "${addr[@]}" "$@"'
export LOCAL_ADDR RDZV_PORT RDZV_ENDPOINT="${RDZV_ENDPOINT:-}" HEAD_NODE="$head_node" APPTAINER_IMAGE="${APPTAINER_IMAGE:-}" APPTAINER_BIND="$ckpt_dir,$DATA_DIR"

nnodes=$SLURM_NNODES
step_opts=(--wait=60)
# --wait, not --kill-on-bad-exit: a node whose step exits 75 first must not have srun kill the
# others while they still save (preemption and the time limit stop every node at once); a node that
# crashes ends the step 60 s later at the latest. Elastic: the step goes on without a lost node.
if [ "${MIN_NODES}" != "$SLURM_NNODES" ]; then
    nnodes=$MIN_NODES:$SLURM_NNODES
    step_opts=(--no-kill --wait=0 --kill-on-bad-exit=0)
fi

if [ -z "${CONTAINER_IMAGE:-}${APPTAINER_IMAGE:-}" ]; then
    # A usage error stops here with exit 2, before torchrun would restart it MAX_RESTARTS times.
    python -m trainer check --nnodes "$nnodes" --nproc-per-node "$NPROC_PER_NODE" --config "$CONFIG" \
        checkpoint.dir="$ckpt_dir" data.dir="$data_dir" "$@"
fi

requeue=0
# shellcheck disable=SC2329  # called by the trap
on_usr1() {
    requeue=1
    echo "slurm: time limit near (USR1); asking the job step to checkpoint and stop"
    scancel --signal=TERM "$SLURM_JOB_ID"   # reaches torchrun in every step; it forwards to workers
}
trap on_usr1 USR1

set +e
# since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: pass it on, or each task gets one CPU
cpus=()
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
srun --ntasks-per-node=1 "${step_opts[@]}" "${cpus[@]}" "${container[@]}" bash -c "$node_cmd" trainer-torchrun \
    --nnodes="$nnodes" --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    "${rdzv[@]}" --rdzv-id="$SLURM_JOB_ID" \
    -m trainer train --config "$CONFIG" checkpoint.dir="$ckpt_dir" data.dir="$data_dir" "$@" &
srun_pid=$!
wait "$srun_pid"
rc=$?
while [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; do   # a trapped signal interrupted wait
    wait "$srun_pid"
    rc=$?
done
set -e

# Preemption (PreemptMode=REQUEUE, with GraceTime) signals the steps only: they save and exit 75, and
# a job that ends within its grace time ends FAILED, not requeued. Slurm has stamped its PreemptTime.
if [ "$rc" = 75 ] && scontrol show job "$SLURM_JOB_ID" | grep -q 'PreemptTime=[0-9]'; then
    echo "slurm: preempted; the job step saved a checkpoint"
    requeue=1
fi
if [ "$requeue" = 1 ] && [ "$rc" != 0 ] && [ "$rc" != 2 ]; then   # not when it finished, nor on bad input
    echo "slurm: requeueing job $SLURM_JOB_ID; it resumes from $ckpt_dir"
    if scontrol requeue "$SLURM_JOB_ID"; then
        exit 0
    fi   # a cancelled job cannot be requeued: it stays stopped, with the contract's 75
fi
exit "$rc"
