#!/usr/bin/env bash
# Mirror-accelerated parity (docs/adr/0009) against plain mirror-2 and parity-2+1 on one lab
# (3 nodes, one 2 GiB RAM drive each, 64 MiB extents). Each volume is 512 MiB; the clients
# work on its first 128 MiB (one span of parity-2+1): the hot set. The mirror-part volume
# has a 256 MiB mirror part, so its hot set lands mirrored. For each: write amplification of
# 4 KiB random writes, 4 KiB random write and read IOPS and daemon CPU per I/O at queue
# depth 16. Then the rotation: a second span fills the mirror part past 85 %, and the time
# until the owner has rotated the colder span into parity gives its rate.
#
#   bench/parity/map.sh            (needs a release build: cargo build --release --bins)
set -euo pipefail
export CONVERGE_LAB_DIR="${CONVERGE_LAB_DIR:-/tmp/converge-map-lab}"
. "$(dirname "$0")/lab.sh"
lab_up 3
printf '%-22s %8s %10s %10s %12s %12s\n' volume "WA 4K" "rd IOPS" "wr IOPS" "rd CPU us/IO" "wr CPU us/IO"
for spec in "mirror-2:" "parity-2+1:" "parity-2+1:256M"; do
  r=${spec%%:*}
  part=${spec#*:}
  name="m${r//[^a-z0-9]/}${part:+mp}"
  extra=()
  label=$r
  if [ -n "$part" ]; then
    extra=(--mirror-part "$part")
    label="$r +$part mirror"
  fi
  "$C" volume create "$name" --size 512M --resiliency "$r" --owner 1 "${extra[@]}" >/dev/null
  uri=$("$C" volume show "$name" --json | python3 -c "import json,sys;print(json.load(sys.stdin)['uri'])")
  f() { fio --name=m --ioengine=nbd --uri="$uri" --size=128M --randseed=7 --output-format=json "$@"; }
  f --rw=write --bs=1M --iodepth=8 >/dev/null
  b=$(metric converge_drive_written_bytes_total)
  f --rw=randwrite --bs=4k --io_size=32M --iodepth=16 >/dev/null
  a=$(metric converge_drive_written_bytes_total)
  wa=$(python3 -c "print('%.2f' % (($a - $b) / (32 << 20)))")
  out=()
  for rw in randread randwrite; do
    b=$(metric converge_process_cpu_seconds_total)
    j=$(f --rw="$rw" --bs=4k --iodepth=16 --time_based --runtime=10)
    a=$(metric converge_process_cpu_seconds_total)
    out+=("$(echo "$j" | python3 -c "
import json,sys
t=sys.stdin.read(); j=json.loads(t[t.index('{'):])['jobs'][0]  # fio may print notes first
k='read' if '$rw'=='randread' else 'write'
ios=j[k]['total_ios']; print('%d %.1f' % (j[k]['iops'], ($a-$b)*1e6/max(ios,1)))")")
  done
  read -r ri rc <<<"${out[0]}"
  read -r wi wc <<<"${out[1]}"
  printf '%-22s %8s %10s %10s %12s %12s\n' "$label" "$wa" "$ri" "$wi" "$rc" "$wc"
  if [ -n "$part" ]; then
    "$C" volume show "$name" | grep -E "^mirror part"
    # A second span: the part is full (100 %), the first span is the colder one.
    fio --name=m --ioengine=nbd --uri="$uri" --offset=128M --size=128M --rw=write --bs=1M \
      --iodepth=8 --output-format=json >/dev/null
    until "$C" volume show "$name" | grep -q "^rotations   1 "; do sleep 0.2; done
    "$C" volume show "$name" | grep -E "^(mirror part|rotations)"
    # The owner's log says how long the copy took (throttled at the resync rate).
    grep -h "rotated from the mirror part" "$CONVERGE_LAB_DIR"/node1/*.log | tail -1 |
      sed 's/.*: span/rotation: span/'
  fi
done
