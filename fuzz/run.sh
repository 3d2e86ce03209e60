#!/usr/bin/env bash
# Builds the fuzz targets and runs each for SECONDS (default 20), one after another, on the
# stable toolchain (cargo fuzz with -s none: see docs/FUZZING.md). Fails if any target
# crashes, panics, hangs or runs out of memory, and prints the input that did it.
#
#   fuzz/run.sh               every target, 20 s each (the quick check)
#   fuzz/run.sh 3600          every target, an hour each (the long run)
#   fuzz/run.sh 300 rpc_wire nbd_session
#
# Seeds come from fuzz/corpus/<target>/ (committed, read-only here); what a run learns goes
# to fuzz/work/corpus/<target>/ and crash inputs to fuzz/artifacts/<target>/ (both ignored
# by git, kept between runs, so later runs start where earlier ones stopped).
set -euo pipefail

seconds="${1:-20}"
shift || true
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -lt 1 ]; then
  echo "usage: fuzz/run.sh [SECONDS] [TARGET...]" >&2
  exit 2
fi

fuzz_dir="$(cd "$(dirname "$0")" && pwd)"
cd "$fuzz_dir"
export PATH="$HOME/.cargo/bin:$PATH"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi

all_targets=(rpc_wire rpc_session nbd_session engine_open cache_replay api_json node_config)
if [ "$#" -gt 0 ]; then
  targets=("$@")
  for t in "${targets[@]}"; do
    if [ ! -f "fuzz_targets/$t.rs" ]; then
      echo "unknown target $t (known: ${all_targets[*]})" >&2
      exit 2
    fi
  done
else
  targets=("${all_targets[@]}")
fi

# -s none: no sanitizer, so no -Z flag, so the stable compiler builds it. Debug assertions
# (and with them overflow checks) are on: an overflow is a finding too.
build_flags=(-s none --debug-assertions)

echo "== building ${#targets[@]} fuzz target(s)"
start_build=$(date +%s)
for t in "${targets[@]}"; do
  cargo fuzz build "${build_flags[@]}" "$t"
done
echo "build: $(( $(date +%s) - start_build )) s"

failed=()
summary=()
for t in "${targets[@]}"; do
  work="$fuzz_dir/work/corpus/$t"
  artifacts="$fuzz_dir/artifacts/$t"
  log="$fuzz_dir/work/$t.log"
  mkdir -p "$work" "$artifacts"
  before=$(find "$artifacts" -type f | sort)
  echo "== $t: ${seconds} s"
  status=0
  # -timeout: one input running longer is a hang (the session harnesses give up after
  # 10 s with their own message first). -rss_limit_mb: a memory blow-up is a finding.
  cargo fuzz run "${build_flags[@]}" "$t" "$work" "$fuzz_dir/corpus/$t" -- \
    -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1 || status=$?
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  corpus=$(find "$work" -type f | wc -l)
  summary+=("$(printf '%-13s runs %-9s exec/s %-7s corpus %-6s %s' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "$([ "$status" = 0 ] && echo ok || echo FAILED)")")
  if [ "$status" != 0 ]; then
    failed+=("$t")
    echo "!! $t failed (exit $status); the end of its log ($log):"
    tail -40 "$log"
    new=$(comm -13 <(echo "$before") <(find "$artifacts" -type f | sort) | grep . || true)
    for f in $new; do
      echo "!! crash input: $f"
      echo "   reproduce: (cd fuzz && cargo fuzz run ${build_flags[*]} $t $f)"
    done
  else
    echo "   ${last:-}"
  fi
done

echo "== summary (${seconds} s per target)"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
