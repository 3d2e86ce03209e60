#!/usr/bin/env bash
# Installs what converge needs on Debian 12 (root) and builds it. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2: `ip netns`, veth pairs and bridges for `converge lab up --netns` (partitions).
# chromium: the fleet's end-to-end test renders report.html headless and checks the console.
# openssl, systemd: tests read certificates with `openssl x509` and check the packaged units
# with `systemd-analyze verify` (nothing is started under systemd).
# busybox-static: the VM tests' guest image (scripts/guest-image.sh; qemu below).
PKGS=(etcd-server etcd-client fio libnbd-bin nbdkit iproute2 python3-libnbd procps chromium openssl systemd busybox-static)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Debian starts etcd as a service on :2379 when installed; the lab runs its own etcd.

# qemu-utils (qemu-img, qemu-io), qemu-system-x86 (the VM tests boot a guest on a volume
# under TCG: docs/VMS.md) and libvirt's QEMU driver and virsh (a test starts the guest as a
# libvirt domain). On Debian 12 they come from bookworm-backports (qemu 10, libvirt 11):
# qemu's packages must be of one version, and machines of this project's CI have
# backports' qemu-utils already.
VM_PKGS=(qemu-utils qemu-system-x86 libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients)
need_qemu=()
for p in "${VM_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_qemu+=("$p")
done
if [ ${#need_qemu[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  target=()
  if grep -q '^VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
      echo "setup: adding bookworm-backports to apt's sources (for qemu)"
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        | $SUDO tee /etc/apt/sources.list.d/converge-backports.sources >/dev/null
    fi
    target=(-t bookworm-backports)
  fi
  echo "setup: installing ${need_qemu[*]} ${target[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${target[@]}" \
    "${VM_PKGS[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "setup: cargo not found; installing Rust with rustup"
    command -v curl >/dev/null || { apt-get install -y -qq curl >/dev/null; }
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi

PROFILE="${CONVERGE_PROFILE:-release}"
echo "setup: building converge ($PROFILE)"
if [ "$PROFILE" = release ]; then
  cargo build --release --workspace --bins --quiet
else
  cargo build --workspace --bins --quiet
fi
