#!/usr/bin/env bash
# Make a private certificate authority and one certificate signed by it, for trying a TLS
# cluster (start_scheduler.sh / start_workers.sh with TLS_DIR=DIR, train.py --tls-*).
#
#   examples/cluster/make_certs.sh [DIR]     # default DIR: ./certs
#
# Writes DIR/ca.pem (the CA's certificate: every endpoint trusts certificates it signed),
# DIR/cert.pem and DIR/key.pem (the one identity the scheduler, workers and clients present
# here; Dask's TLS checks the signature, not the host name). Copy DIR to every machine.
# In production give each kind of endpoint its own key, keep ca-key.pem off the cluster,
# and renew before the 365 days run out.
set -euo pipefail

DIR=${1:-certs}
DAYS=${DAYS:-365}
mkdir -p "$DIR"
umask 077  # private keys readable by their owner only

openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=dasktrain cluster CA" \
    -keyout "$DIR/ca-key.pem" -out "$DIR/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=dasktrain" \
    -keyout "$DIR/key.pem" -out "$DIR/cert.csr" 2>/dev/null
printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" > "$DIR/cert.ext"
openssl x509 -req -in "$DIR/cert.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca-key.pem" \
    -CAcreateserial -days "$DAYS" -extfile "$DIR/cert.ext" -out "$DIR/cert.pem" 2>/dev/null
rm -f "$DIR/cert.csr" "$DIR/cert.ext" "$DIR/ca.srl"
chmod 644 "$DIR/ca.pem" "$DIR/cert.pem"
echo "made $DIR/ca.pem, $DIR/cert.pem, $DIR/key.pem"
