#!/usr/bin/env bash
# Builds the previous release's converge and converged (for the rolling-upgrade test,
# crates/cli/tests/upgrade.rs) into target/prev-release/<commit>/bin, once: a later run
# finds them there. Prints that bin directory.
#
# The release is the newest line of RELEASES (name and commit). Its source comes from git
# (the commit must be in this clone's history); the compiled dependencies of this tree's
# target/release are hard-linked in first, so only the release's own crates compile.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
read -r name commit < <(grep -v '^#' RELEASES | tail -n 1)
out="target/prev-release/$commit"
if [ -x "$out/bin/converged" ] && [ -x "$out/bin/converge" ]; then
  echo "$PWD/$out/bin"
  exit 0
fi
if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "prev-release: commit $commit of $name is not in this clone's history (a shallow clone?); fetch it with git fetch --unshallow" >&2
  exit 1
fi
rm -rf "$out"
mkdir -p "$out/src" "$out/target/release"
# -m: the files get today's mtime, so no artifact of another tree passes for theirs.
git archive "$commit" | tar -x -m -C "$out/src"
if [ -d target/release/deps ]; then
  cp -al target/release/deps target/release/.fingerprint target/release/build "$out/target/release/" 2>/dev/null || true
fi
echo "prev-release: building $name ($commit) into $out/bin" >&2
(cd "$out/src" && CARGO_TARGET_DIR="$PWD/../target" cargo build --release --bins --quiet)
mkdir -p "$out/bin"
cp "$out/target/release/converge" "$out/target/release/converged" "$out/bin/"
# Only the binaries are kept: the sources and objects would double the target directory.
rm -rf "$out/src" "$out/target"
echo "$PWD/$out/bin"
