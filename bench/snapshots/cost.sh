#!/usr/bin/env bash
# What a snapshot costs the writes after it, per layout (docs/SNAPSHOTS.md): on a 3-node
# RAM lab, a 256 MiB volume of each kind is filled (1 MiB writes; data that compresses to
# about a quarter), then 4 KiB random writes at queue depth 16 run twice for RUNTIME
# seconds each: before any snapshot, and right after one (most of those writes are then
# the first write of their block, or row, since the snapshot: what the copies keep for it
# is moved, or for packed and parity states copied). Prints IOPS and the drives' bytes
# written per client byte for both, and their ratio.
#
#   bench/snapshots/cost.sh [RUNTIME]      (needs a release build: cargo build --release --bins)
#
# Expected: mirror-3 moves what it keeps (no data written: the same); a compressed
# mirror-3 copies the packed states it replaces (one 4 KiB write more per block); a
# parity-2+1 volume copies each chunk's block of a row (three more per row written).
set -euo pipefail
runtime="${1:-8}"
export CONVERGE_LAB_DIR="${CONVERGE_LAB_DIR:-/tmp/converge-snapcost-lab}"
. "$(dirname "$0")/../parity/lab.sh"
lab_up 3
printf '%-18s %10s %10s %8s %8s %8s\n' volume "IOPS" "IOPS snap" ratio "WA" "WA snap"
for spec in "mirror-3 none" "mirror-3 lz4" "parity-2+1 none"; do
  set -- $spec
  name="c${1//[^a-z0-9]/}$2"
  "$C" volume create "$name" --size 256M --resiliency "$1" --compression "$2" --owner 1 >/dev/null
  uri=$("$C" volume show "$name" --json | python3 -c "import json,sys;print(json.load(sys.stdin)['uri'])")
  f() {
    fio --name=m --ioengine=nbd --uri="$uri" --size=256M --randseed=7 --refill_buffers \
      --buffer_compress_percentage=75 --buffer_compress_chunk=4k --output-format=json "$@"
  }
  f --rw=write --bs=1M --iodepth=8 >/dev/null
  res=()
  for pass in plain snap; do
    if [ "$pass" = snap ]; then
      "$C" volume snapshot create "$name" s1 >/dev/null
    fi
    b=$(metric converge_drive_written_bytes_total)
    j=$(f --rw=randwrite --bs=4k --iodepth=16 --time_based --runtime="$runtime" --randrepeat=0)
    a=$(metric converge_drive_written_bytes_total)
    res+=("$(echo "$j" | python3 -c "
import json,sys
t=sys.stdin.read(); j=json.loads(t[t.index('{'):])['jobs'][0]['write']
print('%d %.2f' % (j['iops'], ($a - $b) / max(j['io_bytes'], 1)))")")
  done
  "$C" volume snapshot delete "$name" s1 >/dev/null
  read -r i0 w0 <<<"${res[0]}"
  read -r i1 w1 <<<"${res[1]}"
  printf '%-18s %10s %10s %8s %8s %8s\n' "$1 $2" "$i0" "$i1" \
    "$(python3 -c "print('%.2f' % ($i1 / max($i0, 1)))")" "$w0" "$w1"
done
