#!/bin/sh
# Create or update Mosquitto users for polca with random passwords, for the pattern ACL
# (`acl`) of this folder: the service users, one user per node, named like the node, and
# one per CDU source, named like the CDU id (a CDU, `polca cdu modbus` or `polca cdu simulate`).
#
#   PASSWORD_FILE=/etc/mosquitto/passwd SECRETS_DIR=./mqtt-secrets \
#     ./make-passwords.sh polca-aggregator polca-scheduler polca-viewer meter node1 node2 cdu1
#
# Each password is kept in $SECRETS_DIR/<user>.pass (mode 600; reused when present, so
# rerunning adds users without changing the others) for distribution: a node's file
# becomes /etc/polca/mqtt.pass on that node, the aggregator's
# /etc/polca/aggregator-mqtt.pass. Passwords reach mosquitto_passwd on stdin, never on a
# command line. For the strict per-node ACL, make-acl.py writes the same commands.
set -eu
if [ "$#" -eq 0 ]; then
  echo "usage: [PASSWORD_FILE=...] [SECRETS_DIR=...] $0 USER..." >&2
  exit 2
fi
# The broker's password file (created, mode 600, if missing).
PASSWORD_FILE="${PASSWORD_FILE:-/etc/mosquitto/passwd}"
# Where the plain passwords are kept for distribution (mode 700).
SECRETS_DIR="${SECRETS_DIR:-./mqtt-secrets}"
umask 077
mkdir -p "$SECRETS_DIR"
[ -e "$PASSWORD_FILE" ] || : > "$PASSWORD_FILE"

for user in "$@"; do
  case "$user" in
    *[!A-Za-z0-9_.-]* | "")
      echo "$0: '$user' is not a valid user name (letters, digits, _ . -)" >&2
      exit 2
      ;;
  esac
  secret="$SECRETS_DIR/$user.pass"
  if [ ! -s "$secret" ]; then
    # 128 random bits as 32 hex digits.
    od -An -tx1 -N16 /dev/urandom | tr -d ' \n' > "$secret"
    echo >> "$secret"
  fi
  password=$(head -n 1 "$secret")
  printf '%s\n%s\n' "$password" "$password" \
    | mosquitto_passwd "$PASSWORD_FILE" "$user" > /dev/null
  echo "$user: $secret"
done
