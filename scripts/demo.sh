#!/usr/bin/env bash
# The main job: set up, start a 4-node lab cluster on this machine, create a mirror-3
# volume, write and verify it with fio over NBD, show the cluster's status, and run a
# quick small-block fleet (the IOPS / latency table of a reference architecture). Each node
# has a 256 MiB cache drive in RAM in front of its capacity drives (mode write).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/target/release:$PATH"
export CONVERGE_LAB_DIR="${CONVERGE_LAB_DIR:-$PWD/converge-lab}"

converge lab down >/dev/null 2>&1 || true
converge lab down --purge >/dev/null 2>&1 || true
converge lab up --nodes 4 --drives-per-node 2 --drive-size 2G \
    --cache-drives 1 --cache-size 256M --cache-in-ram
eval "$(converge lab env)"

converge volume create vm01 --size 1G --resiliency mirror-3
URI=$(converge volume show vm01 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["uri"])')
echo "== fio: 4 KiB random writes with crc32c verify, then read-back verify, on $URI"
fio --name=demo --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=16 \
    --size=256M --io_size=64M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --do_verify=1 \
    --group_reporting --output-format=normal | grep -E "IOPS|lat \(usec\): min|err=|verify" || true
echo "== nbdinfo"
nbdinfo "$URI" | grep -E "export-size|block_size" || true
echo "== converge status"
converge status
echo "== converge cache status"
converge cache status
FLEET_OUT="$PWD/fleet-results/quick-small-block-$(date +%Y%m%d-%H%M%S)"
echo
echo "== converge fleet: quick small-block sweep (16 points; a few minutes on a laptop)"
converge fleet run --profile small-block --quick --out "$FLEET_OUT"
echo
echo "The lab keeps running. Try: eval \"\$(converge lab env)\"; converge volume list"
echo "Fleet report: $FLEET_OUT/report.html (converge fleet report DIR [DIR ...] compares runs)"
echo "Stop it with: converge lab down   (add --purge to delete its data)"
