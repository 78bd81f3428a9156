#!/usr/bin/env bash
# Start this machine's Dask workers and connect them to the scheduler.
#
#   examples/cluster/start_workers.sh tcp://SCHEDULER:8786 [more `dask worker` options]
#
# Without GPUs: NWORKERS single-threaded worker processes (default: one per core). One thread
# per process keeps torch and numpy from fighting over cores, and processes keep the GIL out
# of the data path (as dasktrain's own LocalCluster does).
#
# With GPUs (found with nvidia-smi, or set GPUS=N): one worker process per GPU, each seeing
# only its own GPU (CUDA_VISIBLE_DEVICES) and declaring `--resources GPU=1`. dasktrain's
# trainer notices the GPU resource and asks for GPU=1 for each trainer task, so every model
# replica gets a GPU of its own and runs on CUDA: use Trainer(workers=...) at most the
# number of GPU workers. Data-loading tasks ask for no GPU and run on any worker. NWORKERS
# then adds CPU-only workers (default 0), e.g. a roomy one for the parameter holder
# (Trainer(holder_worker=ADDRESS)).
#
# Settings (environment variables):
#   HOST          address the workers listen on: other machines' workers must reach it
#                 (default 127.0.0.1, right only when everything runs on this machine)
#   NWORKERS      CPU worker processes (default: cores without GPUs, 0 with)
#   GPUS          GPU worker processes (default: the GPUs nvidia-smi lists; 0 to ignore them)
#   MEMORY_LIMIT  per worker process (default auto: this machine's memory / processes).
#                 Dask pauses a worker at 80 % of it and restarts it at 95 %: a trainer worker
#                 needs ~400 MiB plus its model and prefetched batches, the holder's worker
#                 about 4x the model more (see the README's "Memory").
#   TLS_DIR       a directory made by make_certs.sh: connect over tls:// (the scheduler must
#                 run with the same TLS_DIR). By hand: --tls-ca-file ca.pem --tls-cert
#                 cert.pem --tls-key key.pem
#   DASK          the dask command (default: `dask` on PATH)
set -euo pipefail

SCHEDULER=${1:?usage: start_workers.sh SCHEDULER_ADDRESS [dask worker options]}
shift
HOST=${HOST:-127.0.0.1}
MEMORY_LIMIT=${MEMORY_LIMIT:-auto}
DASK=${DASK:-dask}

if [[ -z "${GPUS:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPUS=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    else
        GPUS=0
    fi
fi
if (( GPUS > 0 )); then
    NWORKERS=${NWORKERS:-0}
else
    NWORKERS=${NWORKERS:-$(nproc)}
fi

tls=()
if [[ -n "${TLS_DIR:-}" ]]; then
    tls=(--tls-ca-file "$TLS_DIR/ca.pem" --tls-cert "$TLS_DIR/cert.pem"
         --tls-key "$TLS_DIR/key.pem")
fi

pids=()
for (( gpu = 0; gpu < GPUS; gpu++ )); do
    CUDA_VISIBLE_DEVICES=$gpu "$DASK" worker "$SCHEDULER" --name "$(hostname)-gpu$gpu" \
        --host "$HOST" --nworkers 1 --nthreads 1 --memory-limit "$MEMORY_LIMIT" \
        --resources "GPU=1" ${tls[@]+"${tls[@]}"} "$@" &
    pids+=($!)
done
if (( NWORKERS > 0 )); then
    # CPU workers see no GPU, so nothing they run takes GPU memory from the trainers.
    CUDA_VISIBLE_DEVICES="" "$DASK" worker "$SCHEDULER" --host "$HOST" \
        --nworkers "$NWORKERS" --nthreads 1 --memory-limit "$MEMORY_LIMIT" \
        ${tls[@]+"${tls[@]}"} "$@" &
    pids+=($!)
fi
if (( ${#pids[@]} == 0 )); then
    echo "start_workers.sh: no workers to start (GPUS=0 and NWORKERS=0)" >&2
    exit 2
fi

# Stopping this script (Ctrl-C, kill) stops its workers; they close gracefully on SIGTERM.
stop() {
    trap - TERM INT
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait
}
trap 'stop; exit 143' TERM
trap 'stop; exit 130' INT
wait
