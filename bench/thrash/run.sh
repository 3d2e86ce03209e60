#!/usr/bin/env bash
# The long thrash, in one command: the three thrash tests of crates/cli/tests/thrash.rs, one after
# the other, each with SECONDS of faults and the same SEED:
#   * thrash: kill -9 and restart, pause, partition (a node's link cut), cut (the link
#     between two nodes only, both still reaching etcd), bit rot and, once (the fourth
#     fault), a failed drive whose copies must be rebuilt elsewhere, on every node, node 1
#     (where the checkers start) included, while a checker client per volume verifies every
#     acked write and reconnects through another node when its node dies;
#   * thrash_with_cache_drives: the same with a RAM cache drive per node and the cache mode
#     switched at random among the faults.
# Prints each fault as it is injected and each test's summary (faults by kind and by node,
# writes, reads, bytes verified, lost connections and unacked writes, verify failures,
# client-visible I/O errors); exits non-zero if a test fails. The whole output goes to
# OUT/thrash.log; a failed test keeps its lab's logs in /tmp/converge-failed/.
# Needs root (the lab runs each node in its own network namespace).
#   bench/thrash/run.sh [SECONDS] [SEED]        (default 600 s, seed from the clock)
set -euo pipefail
cd "$(dirname "$0")/../.."
secs="${1:-600}"
seed="${2:-$(date +%s)}"
out="${CONVERGE_THRASH_OUT:-/tmp/converge-thrash-${seed}}"
mkdir -p "$out"
echo "thrash: ${secs}s of faults per test, seed ${seed} (replay with: bench/thrash/run.sh ${secs} ${seed}); log in ${out}/thrash.log"
cargo build --release --bins --quiet
# cargo test, not nextest: nextest's slow-test timeout would end a long run. One test at a
# time: each runs a whole lab.
set +e
CONVERGE_THRASH_SECS="$secs" CONVERGE_THRASH_CACHE_SECS="$secs" CONVERGE_THRASH_PARITY_SECS="$secs" CONVERGE_THRASH_SEED="$seed" \
    cargo test --release -p converge-cli --test thrash -- --nocapture --test-threads=1 2>&1 \
    | tee "$out/thrash.log" \
    | grep --line-buffered -E '^thrash|^test |test result|panicked|verify failures|I/O errors|logs are kept'
status="${PIPESTATUS[0]}"
set -e
exit "$status"
