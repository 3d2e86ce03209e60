# Sourced by bench/parity/*.sh: `lab_up NODES` starts a fresh RAM lab in $CONVERGE_LAB_DIR
# (one 2 GiB drive per node, 64 MiB extents; torn down on exit), sets $C (the release
# CLI), and `metric NAME` sums a /metrics counter over every node.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
C="$root/target/release/converge"
lab_up() {
  "$C" lab down --purge >/dev/null 2>&1 || true
  rm -rf "$CONVERGE_LAB_DIR"
  "$C" lab up --nodes "$1" --drives-per-node 1 --drive-size 2G --slab-size 64M --ram >/dev/null
  trap '"$C" lab down --purge >/dev/null 2>&1 || true' EXIT
  TOKEN=$(cat "$CONVERGE_LAB_DIR/admin.token")
  CA="$CONVERGE_LAB_DIR/pki/ca.crt"
  apis=$(python3 -c "import json;[print(n['api']) for n in json.load(open('$CONVERGE_LAB_DIR/lab.json'))['nodes']]")
}
metric() {
  local sum=0 v
  for api in $apis; do
    v=$(curl -s --cacert "$CA" -H "Authorization: Bearer $TOKEN" "$api/metrics" |
      awk -v m="$1" '$1 ~ "^"m"({|$)" {s+=$2} END {printf "%.3f", s}')
    sum=$(python3 -c "print($sum + $v)")
  done
  echo "$sum"
}
