#!/usr/bin/env bash
# Runs the thrash test (crates/cli/tests/thrash.rs) for as long as asked and prints the
# fault counts and the result. Needs root (the lab runs nodes in network namespaces).
#   bench/thrash/run.sh [SECONDS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/../.."
secs="${1:-600}"
seed="${2:-$(date +%s)}"
echo "thrash: ${secs}s of faults, seed ${seed} (replay with: bench/thrash/run.sh ${secs} ${seed})"
cargo build --release --bins >/dev/null
CONVERGE_THRASH_SECS="$secs" CONVERGE_THRASH_SEED="$seed" \
    cargo test --release -p converge-cli --test thrash -- --nocapture 2>&1 \
    | grep -E '^thrash|test result|panicked|verify|error' || true
