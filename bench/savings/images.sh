#!/usr/bin/env bash
# bench/savings/images.sh DIR [N] -- a realistic set of VM disks for bench/savings/estimate.py:
# one Debian 12 template (debootstrap, minbase + a kernel-less server set) and N VMs made
# from it, each diverging the way VMs from one golden image do (its own packages, logs,
# host keys, apt lists), each written out as a 2 GiB raw ext4 image (mkfs.ext4 -d: no loop
# device needed). Downloads from the Debian mirror only. Root.
set -euo pipefail
DIR=$(realpath -m "${1:?usage: images.sh DIR [N]}")
N=${2:-6}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
command -v debootstrap >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}
mkdir -p "$DIR"
T="$DIR/template"
if [ ! -e "$T/etc/debian_version" ]; then
  log "debootstrap bookworm into $T"
  debootstrap --variant=minbase --include=openssh-server,systemd-sysv,python3,ca-certificates \
    bookworm "$T" "$MIRROR" >"$DIR/debootstrap.log" 2>&1
fi
# What each VM adds to the template: a role's packages.
roles=(nginx-light postgresql-15 redis-server perl-modules-5.36 python3-flask rsyslog \
       apache2 mariadb-server)
images=()
for i in $(seq 1 "$N"); do
  V="$DIR/vm$i"
  img="$DIR/vm$i.img"
  images+=("$img")
  [ -e "$img" ] && continue
  rm -rf "$V"
  cp -a "$T" "$V"
  pkg=${roles[$(( (i - 1) % ${#roles[@]} ))]}
  log "vm$i: installing $pkg"
  mount -t proc proc "$V/proc"
  chroot "$V" /bin/sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends $pkg" >"$DIR/vm$i.log" 2>&1 || true
  umount "$V/proc"
  # What a running VM writes of its own: host keys, a machine id, logs.
  rm -f "$V"/etc/ssh/ssh_host_* && chroot "$V" ssh-keygen -A >/dev/null 2>&1 || true
  head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$V/etc/machine-id"
  mkdir -p "$V/var/log/app"
  for d in $(seq 1 20); do
    seq 1 2000 | sed "s/^/vm$i day $d request /" >"$V/var/log/app/access.$d.log"
  done
  rm -f "$img"
  truncate -s 2G "$img"
  mkfs.ext4 -q -F -d "$V" "$img"
  rm -rf "$V"
done
printf '%s\n' "${images[@]}"
