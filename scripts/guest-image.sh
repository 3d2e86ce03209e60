#!/usr/bin/env bash
# Builds the tiny Linux guest the VM tests boot (docs/VMS.md): Debian 12's kernel (from its
# package, not installed on the host) and an initramfs of busybox-static, the kernel's
# virtio block modules and an /init that runs one job on the guest's first virtio disk
# (/dev/vda, a converge volume attached by qemu) and prints its result on the serial
# console. Output: OUT/vmlinuz and OUT/initrd.gz (default OUT: target/guest). Needs
# apt-get (the kernel package is downloaded, once, into OUT/cache) and busybox-static;
# scripts/setup.sh installs what is missing. Safe to run again: an image already built from
# the same kernel and this script is kept.
#
# --with-fio (before OUT; default OUT then target/guest-fio): the image also holds the
# host's fio with its libraries (about 80 MB; the vhost-user-blk vs NBD benchmark,
# bench/vms/) and the fio job.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_FIO=0
if [ "${1:-}" = "--with-fio" ]; then
  WITH_FIO=1
  shift
  command -v fio >/dev/null || { echo "guest-image: fio is missing (scripts/setup.sh installs it)" >&2; exit 1; }
fi
if [ $WITH_FIO = 1 ]; then OUT="${1:-target/guest-fio}"; else OUT="${1:-target/guest}"; fi
mkdir -p "$OUT/cache"
OUT="$(cd "$OUT" && pwd)"

command -v busybox >/dev/null && busybox --list | grep -x cpio >/dev/null || {
  echo "guest-image: busybox-static is missing (scripts/setup.sh installs it)" >&2
  exit 1
}
# The kernel package linux-image-amd64 points at.
kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}
KPKG="$(kernel_package)"
if [ -z "$KPKG" ]; then
  apt-get update -qq || true
  KPKG="$(kernel_package)"
fi
[ -n "$KPKG" ] || { echo "guest-image: apt knows no linux-image-amd64 package" >&2; exit 1; }
STAMP="$KPKG $(sha256sum "$0" | cut -c1-16) fio=$WITH_FIO"
if [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$STAMP" ] && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initrd.gz" ]; then
  exit 0
fi
DEB="$(ls "$OUT/cache/${KPKG}"_*.deb 2>/dev/null | head -1 || true)"
if [ -z "$DEB" ]; then
  echo "guest-image: downloading $KPKG"
  (cd "$OUT/cache" && apt-get download -q "$KPKG" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
  DEB="$(ls "$OUT/cache/${KPKG}"_*.deb 2>/dev/null | head -1 || true)"
  [ -n "$DEB" ] || { echo "guest-image: could not download $KPKG" >&2; exit 1; }
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
dpkg-deb -x "$DEB" "$WORK/k"
cp "$WORK"/k/boot/vmlinuz-* "$OUT/vmlinuz"
ROOT="$WORK/root"
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,lib/modules}
cp "$(command -v busybox)" "$ROOT/bin/busybox"
# virtio-blk and what it needs, in load order (Debian builds them as modules).
MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk"
for m in $MODS; do
  f="$(find "$WORK/k/lib/modules" -name "$m.ko" | head -1)"
  [ -n "$f" ] || { echo "guest-image: $m.ko is not in $KPKG" >&2; exit 1; }
  cp "$f" "$ROOT/lib/modules/"
done
if [ $WITH_FIO = 1 ]; then
  # fio and every library it links, at their paths, with the dynamic loader.
  for f in "$(command -v fio)" $(ldd "$(command -v fio)" | grep -o '/[^ ]*'); do
    mkdir -p "$ROOT$(dirname "$f")"
    cp -L "$f" "$ROOT$f"
  done
  mkdir -p "$ROOT/bin"
  [ -e "$ROOT/bin/fio" ] || ln -s "$(command -v fio)" "$ROOT/bin/fio"
fi
cat > "$ROOT/init" <<EOF
#!/bin/busybox sh
# The converge test guest (scripts/guest-image.sh). Kernel parameters:
#   converge.job=write   write converge.mib MiB of random data to /dev/vda (O_DIRECT),
#                        read it back (O_DIRECT) and compare
#   converge.job=read    read converge.mib MiB of /dev/vda (O_DIRECT)
#   converge.job=loop    for converge.secs seconds, write two random images in turn
#                        (O_DIRECT, fsync) and read each back and compare; prints
#                        "CONVERGE-GUEST loop-started" first, and the last image's sha256
#   converge.job=fio     (an image built --with-fio) for each RW:BS:QD of converge.fio
#                        (comma-separated, e.g. randread:4k:1,randwrite:4k:32), fio with
#                        libaio and O_DIRECT over the first converge.mib MiB of /dev/vda
#                        for converge.secs seconds (after 1 s of ramp); prints each
#                        result as one line "CONVERGE-FIO RW BS QD <fio's JSON>"
#   converge.job=fleet   (--with-fio; a `converge fleet run --vms` worker) prints
#                        "CONVERGE-GUEST ready", waits for a line on the console, then
#                        runs fio with converge.fioargs (comma-separated arguments) and
#                        prints its output between CONVERGE-FIO-JSON-BEGIN and -END
# Each prints "CONVERGE-GUEST <job> sha256=<hex> errors=<n> io_errors=<n> passes=<n>"
# (io_errors: the kernel's I/O error messages) and powers off.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $MODS; do insmod /lib/modules/\$m.ko || echo "CONVERGE-GUEST insmod \$m failed"; done
job=none; mib=16; secs=30; passes=0; fiojobs=randread:4k:1
for a in \$(cat /proc/cmdline); do
  case "\$a" in
    converge.job=*) job="\${a#converge.job=}" ;;
    converge.mib=*) mib="\${a#converge.mib=}" ;;
    converge.secs=*) secs="\${a#converge.secs=}" ;;
    converge.fio=*) fiojobs="\${a#converge.fio=}" ;;
    converge.fioargs=*) fioargs="\${a#converge.fioargs=}" ;;
  esac
done
i=0
while [ ! -b /dev/vda ] && [ \$i -lt 300 ]; do sleep 0.1; i=\$((i + 1)); done
errors=0
if [ ! -b /dev/vda ]; then
  echo "CONVERGE-GUEST \$job no-disk"
  poweroff -f
fi
case "\$job" in
  write)
    dd if=/dev/urandom of=/tmp/data bs=1M count=\$mib 2>/dev/null
    want=\$(sha256sum /tmp/data | cut -d' ' -f1)
    dd if=/tmp/data of=/dev/vda bs=1M oflag=direct conv=fsync 2>/tmp/err || errors=\$((errors + 1))
    got=\$(dd if=/dev/vda bs=1M count=\$mib iflag=direct 2>>/tmp/err | sha256sum | cut -d' ' -f1)
    [ "\$got" = "\$want" ] || errors=\$((errors + 1))
    ;;
  read)
    want=\$(dd if=/dev/vda bs=1M count=\$mib iflag=direct 2>/tmp/err | sha256sum | cut -d' ' -f1)
    grep -q "error" /tmp/err && errors=\$((errors + 1))
    ;;
  loop)
    dd if=/dev/urandom of=/tmp/a bs=1M count=\$mib 2>/dev/null
    dd if=/dev/urandom of=/tmp/b bs=1M count=\$mib 2>/dev/null
    sa=\$(sha256sum /tmp/a | cut -d' ' -f1)
    sb=\$(sha256sum /tmp/b | cut -d' ' -f1)
    : > /tmp/err
    echo "CONVERGE-GUEST loop-started"
    end=\$(( \$(cut -d. -f1 /proc/uptime) + secs ))
    while [ \$(cut -d. -f1 /proc/uptime) -lt \$end ]; do
      for f in a b; do
        if [ \$f = a ]; then want=\$sa; else want=\$sb; fi
        dd if=/tmp/\$f of=/dev/vda bs=1M oflag=direct conv=fsync 2>>/tmp/err || errors=\$((errors + 1))
        got=\$(dd if=/dev/vda bs=1M count=\$mib iflag=direct 2>>/tmp/err | sha256sum | cut -d' ' -f1)
        [ "\$got" = "\$want" ] || errors=\$((errors + 1))
        passes=\$((passes + 1))
      done
    done
    ;;
  fio)
    want=none
    for j in \$(echo "\$fiojobs" | tr ',' ' '); do
      rw=\$(echo \$j | cut -d: -f1); bs=\$(echo \$j | cut -d: -f2); qd=\$(echo \$j | cut -d: -f3)
      echo "CONVERGE-FIO-START \$rw \$bs \$qd"
      out=\$(fio --name=guest --filename=/dev/vda --direct=1 --ioengine=libaio --rw=\$rw \\
        --bs=\$bs --iodepth=\$qd --size=\${mib}M --ramp_time=1 --runtime=\$secs --time_based \\
        --randrepeat=0 --output-format=json 2>>/tmp/err) || errors=\$((errors + 1))
      echo "CONVERGE-FIO \$rw \$bs \$qd \$(echo "\$out" | tr -d '\\n')"
    done
    ;;
  fleet)
    want=none
    echo "CONVERGE-GUEST ready"
    read go
    fio \$(echo "\$fioargs" | tr ',' ' ') > /tmp/fio.json 2>>/tmp/err || errors=\$((errors + 1))
    echo "CONVERGE-FIO-JSON-BEGIN"
    cat /tmp/fio.json
    echo "CONVERGE-FIO-JSON-END"
    ;;
  *)
    want=none; errors=1
    ;;
esac
grep -i error /tmp/err | sed 's/^/CONVERGE-GUEST stderr: /'
echo "CONVERGE-GUEST \$job sha256=\$want errors=\$errors io_errors=\$(dmesg | grep -c 'I/O error') passes=\$passes"
poweroff -f
EOF
chmod +x "$ROOT/init"
(cd "$ROOT" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -9 > "$OUT/initrd.gz")
echo "$STAMP" > "$OUT/stamp"
echo "guest-image: $OUT/vmlinuz ($KPKG), $OUT/initrd.gz ($(du -k "$OUT/initrd.gz" | cut -f1) KiB)"
