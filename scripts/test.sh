#!/usr/bin/env bash
# Sets up and runs the whole test suite: lints, unit tests, and end-to-end tests against a
# real etcd, real converged processes and real NBD clients.
set -euo pipefail
cd "$(dirname "$0")/.."
CONVERGE_PROFILE=release ./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "== format and lints"
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml --all -- --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
echo "== the previous release's binaries, for the rolling-upgrade test (built once, then cached)"
CONVERGE_PREV_BIN="$(./scripts/prev-release.sh)"
export CONVERGE_PREV_BIN
echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --release --workspace --no-fail-fast
else
  cargo test --release --workspace --no-fail-fast -- --test-threads=2
fi
echo "== fuzz: every target for 20 s from its committed corpus (docs/FUZZING.md)"
./fuzz/run.sh 20
