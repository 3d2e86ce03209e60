#!/usr/bin/env bash
# Installs what converge needs on Debian 12 (root) and builds it. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2: `ip netns`, veth pairs and bridges for `converge lab up --netns` (partitions).
# chromium: the fleet's end-to-end test renders report.html headless and checks the console.
# openssl, systemd: tests read certificates with `openssl x509` and check the packaged units
# with `systemd-analyze verify` (nothing is started under systemd).
PKGS=(etcd-server etcd-client fio libnbd-bin nbdkit qemu-utils iproute2 python3-libnbd procps chromium openssl systemd)
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
