#!/bin/sh
# make-certs.sh: a CA, certificates and API tokens for a small punchclock
# cluster, with openssl and punchclock itself. Run once on an admin host;
# copy each file only where the table at the end says.
#
#   deploy/tls/make-certs.sh --out DIR [--host NAME_OR_IP]... [--runner ID]...
#                            [--days N] [--punchclock PATH]
#
#   --host     a name or IP the control plane (and etcd) is reached at; the
#              server certificate covers all of them plus localhost and
#              127.0.0.1 (repeat the flag)
#   --runner   a runner id: a client certificate for mTLS (its DNS
#              subjectAltName is the id) and a runner token bound to it
#   --days     certificate lifetime (default 825)
#
# It never overwrites: DIR must not exist. Keys are EC P-256, mode 0600.
# Rotation: run it again into a new DIR, or see README "Security".
set -eu

out= days=825 hosts= runners= pc=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --host) hosts="$hosts $2"; shift 2 ;;
    --runner) runners="$runners $2"; shift 2 ;;
    --days) days=$2; shift 2 ;;
    --punchclock) pc=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "make-certs.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "make-certs.sh: --out DIR is required" >&2; exit 2; }
[ ! -e "$out" ] || { echo "make-certs.sh: $out exists; choose a new directory" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found (apt-get install openssl)" >&2; exit 2; }
if [ -z "$pc" ]; then
  pc=$(command -v punchclock || true)
  [ -n "$pc" ] || [ ! -x target/debug/punchclock ] || pc=target/debug/punchclock
fi
[ -n "$pc" ] || { echo "make-certs.sh: punchclock not found (give --punchclock PATH)" >&2; exit 2; }
case "$pc" in /*) ;; */*) pc="$PWD/$pc" ;; esac   # the script changes directory below
for r in $runners; do
  case "$r" in
    *[!A-Za-z0-9.-]*|''|-*) echo "make-certs.sh: runner id $r: use letters, digits, . and - (it is a DNS name in the certificate)" >&2; exit 2 ;;
  esac
done

umask 077
mkdir -p "$out/tokens"
cd "$out"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# Two CAs: ca.crt for the punchclock API (its server certificate and the
# runners' client certificates), etcd-ca.crt for etcd (its server
# certificate and the control plane's client certificate). etcd trusts
# only etcd-ca.crt, so a runner's certificate can never open etcd.
mkca() {
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -sha256 -days "$days" -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$1.crt"
}
mkca ca "punchclock API CA"
mkca etcd-ca "punchclock etcd CA"

# sign CA NAME SUBJECT SAN EKU: NAME.key and NAME.crt signed by CA.
sign() {
  key "$2.key"
  openssl req -new -key "$2.key" -subj "$3" -out "$2.csr"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' "$5" "$4" > "$2.ext"
  openssl x509 -req -in "$2.csr" -CA "$1.crt" -CAkey "$1.key" -CAcreateserial -days "$days" -sha256 -extfile "$2.ext" -out "$2.crt" 2>/dev/null
  rm -f "$2.csr" "$2.ext" "$1.srl"
}

# The control plane's server certificate, and etcd's (same names: etcd runs
# on the control-plane hosts or beside them). Server use only: neither can
# pose as a runner.
san="DNS:localhost,IP:127.0.0.1,IP:::1"
for h in $hosts; do
  case "$h" in
    localhost|127.0.0.1|::1) ;;          # already there
    *:*) san="$san,IP:$h" ;;            # IPv6
    *[!0-9.]*) san="$san,DNS:$h" ;;      # a name
    *) san="$san,IP:$h" ;;              # IPv4
  esac
done
sign ca server "/CN=punchclock" "$san" "serverAuth"
# etcd's: client use too, for its own gRPC gateway and as its peer
# certificate (--peer-cert-file); signed by the etcd CA, which no runner has.
sign etcd-ca etcd-server "/CN=etcd" "$san" "serverAuth,clientAuth"
# The control plane's client certificate for etcd (--etcd-cert; with etcd
# auth on, etcd maps its CN to the etcd user "punchclock").
sign etcd-ca etcd-client "/CN=punchclock" "DNS:punchclock" "clientAuth"
# One client certificate per runner: its DNS subjectAltName is the runner id.
for r in $runners; do
  sign ca "runner-$r" "/CN=$r" "DNS:$r" "clientAuth"
done

# Tokens: one per role for people and scripts, one per runner.
{
  echo "# punchclock tokens file (server --auth-file). Hashes only; the tokens are in tokens/."
  echo "tokens:"
  "$pc" token new --name admin --role admin --out tokens/admin.token
  "$pc" token new --name operator --role operator --out tokens/operator.token
  "$pc" token new --name reader --role reader --out tokens/reader.token
  for r in $runners; do
    "$pc" token new --name "runner-$r" --role runner --runner-id "$r" --out "tokens/runner-$r.token"
  done
} > tokens.yaml

chmod 0644 ca.crt etcd-ca.crt server.crt etcd-server.crt etcd-client.crt
for r in $runners; do chmod 0644 "runner-$r.crt"; done

cat <<DONE
Made in $out:
  ca.crt                      every punchclock host (clients and runners: --ca-file; server: --client-ca)
  server.crt, server.key      control-plane hosts: server --tls-cert/--tls-key
  etcd-ca.crt                 control-plane hosts (server --etcd-ca) and etcd (--trusted-ca-file)
  etcd-server.crt/.key        etcd members: --cert-file/--key-file and --peer-cert-file/--peer-key-file
  etcd-client.crt/.key        control-plane hosts: server --etcd-cert/--etcd-key
  runner-ID.crt/.key          runner ID only: runner --tls-cert/--tls-key (mTLS)
  tokens.yaml                 control-plane hosts: server --auth-file (hashes only)
  tokens/NAME.token           the one who uses it: --token-file / PUNCHCLOCK_TOKEN_FILE
Keep ca.key and etcd-ca.key offline: they sign new certificates.
DONE
