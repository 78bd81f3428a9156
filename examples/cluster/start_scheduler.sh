#!/usr/bin/env bash
# Start the Dask scheduler of a dasktrain cluster (one per cluster, on any machine the workers
# and the training script can reach).
#
#   examples/cluster/start_scheduler.sh                   # tcp://127.0.0.1:8786, this machine only
#   HOST=10.0.0.5 examples/cluster/start_scheduler.sh     # reachable from the other machines
#
# Settings (environment variables; anything after them on the command line goes to
# `dask scheduler` as it is, e.g. --no-dashboard or --scheduler-file FILE):
#   HOST       address to listen on (default 127.0.0.1: nothing outside this machine can
#              connect; give the address of the cluster's network, never a public one)
#   PORT       port to listen on (default 8786; 0 picks a free one, see --scheduler-file)
#   DASHBOARD  address of the diagnostics dashboard (default HOST:8787; it needs bokeh,
#              without which the scheduler starts without one)
#   TLS_DIR    a directory made by make_certs.sh (ca.pem, cert.pem, key.pem): serve tls://
#              instead of tcp://, and accept only endpoints holding a certificate of that CA.
#              By hand that is:
#                dask scheduler --protocol tls --tls-ca-file ca.pem --tls-cert cert.pem \
#                               --tls-key key.pem ...
#   DASK       the dask command (default: `dask` on PATH, e.g. .venv/bin/dask)
set -euo pipefail

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8786}
DASHBOARD=${DASHBOARD:-$HOST:8787}
DASK=${DASK:-dask}

tls=()
if [[ -n "${TLS_DIR:-}" ]]; then
    tls=(--protocol tls --tls-ca-file "$TLS_DIR/ca.pem" --tls-cert "$TLS_DIR/cert.pem"
         --tls-key "$TLS_DIR/key.pem")
fi

exec "$DASK" scheduler --host "$HOST" --port "$PORT" --dashboard-address "$DASHBOARD" \
    ${tls[@]+"${tls[@]}"} "$@"
