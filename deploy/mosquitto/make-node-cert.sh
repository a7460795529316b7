#!/usr/bin/env bash
# Issue one node's MQTT client certificate: its CN is the node name, which the broker's node
# listener takes as the user name (use_identity_as_username) and as the client id
# (use_username_as_clientid), so the certificate is the node's one credential: it can
# publish only as that node (the ACL's %u) and cannot take over another node's session.
#
#   make-node-cert.sh CA_CERT CA_KEY NODE OUT_DIR [DAYS]
#
# Writes OUT_DIR/NODE.key (EC P-256, mode 600) and OUT_DIR/NODE.crt (clientAuth, signed by
# the CA, DAYS days: default 397), and prints the certificate's fingerprint and expiry. The
# CA must be one used for nothing else: any certificate it signs logs in. Rotating a node's
# certificate: issue a new one, install it on the node (mqtt.tls_cert_file and
# mqtt.tls_key_file, or the agent pod's Secret), restart the agent, then revoke the old one
# (add it to the CRL the listener's crlfile names). NODE is a polca node name
# ([A-Za-z0-9_.-], at most 128 characters), as in the agent's topics.node.
set -euo pipefail
if [ $# -lt 4 ] || [ $# -gt 5 ]; then
  echo "usage: make-node-cert.sh CA_CERT CA_KEY NODE OUT_DIR [DAYS]" >&2
  exit 2
fi
ca_cert="$1" ca_key="$2" node="$3" out="$4" days="${5:-397}"
if ! [[ "$node" =~ ^[A-Za-z0-9_.-]{1,128}$ ]]; then
  echo "make-node-cert.sh: $node is not a node name ([A-Za-z0-9_.-], at most 128)" >&2
  exit 2
fi
if ! [[ "$days" =~ ^[0-9]{1,5}$ ]] || [ "$days" -lt 1 ]; then
  echo "make-node-cert.sh: DAYS must be a whole number of days, not $days" >&2
  exit 2
fi
for file in "$ca_cert" "$ca_key"; do
  [ -r "$file" ] || { echo "make-node-cert.sh: cannot read $file" >&2; exit 66; }
done
command -v openssl >/dev/null || { echo "make-node-cert.sh: openssl is missing" >&2; exit 69; }
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
umask 077
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$work/node.key" -out "$work/node.csr" -subj "/CN=$node" 2>/dev/null
printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' \
  >"$work/ext.cnf"
openssl x509 -req -in "$work/node.csr" -CA "$ca_cert" -CAkey "$ca_key" -CAcreateserial \
  -CAserial "$work/ca.srl" -days "$days" -extfile "$work/ext.cnf" -out "$work/node.crt" 2>/dev/null
install -m 600 "$work/node.key" "$out/$node.key"
install -m 644 "$work/node.crt" "$out/$node.crt"
openssl x509 -in "$out/$node.crt" -noout -subject -fingerprint -sha256 -enddate
