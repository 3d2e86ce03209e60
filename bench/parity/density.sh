#!/usr/bin/env bash
# Parity against mirror-3 on one lab (6 nodes, one 2 GiB RAM drive each, 64 MiB extents):
# usable capacity per raw byte (`converge status`), write amplification (bytes the drives
# wrote / bytes the client wrote, after a prefill) at 4 KiB random and 128 KiB sequential
# writes, and 4 KiB IOPS and daemon CPU per I/O at queue depth 16 for each resiliency.
#
#   bench/parity/density.sh            (needs a release build: cargo build --release --bins)
#
# Theory: mirror-3 writes 3 copies (3.0); parity-K+M writes whole rows, so a 4 KiB write
# costs K+M blocks (3.0 for 2+1, 6.0 for 4+2) and a full row (K+M)/K (1.5 for both).
set -euo pipefail
export CONVERGE_LAB_DIR="${CONVERGE_LAB_DIR:-/tmp/converge-density-lab}"
. "$(dirname "$0")/lab.sh"
lab_up 6
"$C" status | grep -E "^(capacity|usable)"
printf '%-11s %8s %8s %10s %10s %12s %12s\n' resiliency "WA 4K" "WA 128K" "rd IOPS" "wr IOPS" "rd CPU us/IO" "wr CPU us/IO"
for r in mirror-3 parity-2+1 parity-4+2; do
  name="d${r//[^a-z0-9]/}"
  "$C" volume create "$name" --size 512M --resiliency "$r" --owner 1 >/dev/null
  uri=$("$C" volume show "$name" --json | python3 -c "import json,sys;print(json.load(sys.stdin)['uri'])")
  f() { fio --name=m --ioengine=nbd --uri="$uri" --size=512M --randseed=7 --output-format=json "$@"; }
  f --rw=write --bs=1M --iodepth=8 >/dev/null
  wa=()
  for w in "randwrite 4k 64M 16" "write 128k 256M 8"; do
    set -- $w
    b=$(metric converge_drive_written_bytes_total)
    f --rw="$1" --bs="$2" --io_size="$3" --iodepth="$4" >/dev/null
    a=$(metric converge_drive_written_bytes_total)
    wa+=("$(python3 -c "print('%.2f' % (($a - $b) / $(numfmt --from=iec "$3")))")")
  done
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
  printf '%-11s %8s %8s %10s %10s %12s %12s\n' "$r" "${wa[0]}" "${wa[1]}" "$ri" "$wi" "$rc" "$wc"
done
