#!/usr/bin/env bash
# Regenerates include/mscclpp.h from the Rust sources with the pinned cbindgen.
#
#   scripts/gen-header.sh           write include/mscclpp.h
#   scripts/gen-header.sh --check   exit 1 (with a diff) if include/mscclpp.h is out of date
#
# cbindgen CBINDGEN_VERSION is installed on first use with `cargo install --locked` into
# $MSCCLPP_TOOLS_DIR (default ~/.cache/mscclpp-tools). tests/header.rs runs the same check
# through the cbindgen library of the same version.
set -euo pipefail

CBINDGEN_VERSION=0.29.4
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=${MSCCLPP_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-tools}
prefix=$tools/cbindgen-$CBINDGEN_VERSION
cbindgen=$prefix/bin/cbindgen

if [[ ! -x $cbindgen ]]; then
  command -v cargo >/dev/null || { echo "gen-header: cargo not found (install Rust with rustup)" >&2; exit 1; }
  echo "gen-header: installing cbindgen $CBINDGEN_VERSION into $prefix" >&2
  cargo install cbindgen --version "$CBINDGEN_VERSION" --locked --quiet --root "$prefix"
fi

generate() {
  "$cbindgen" --quiet --config "$root/cbindgen.toml" --output "$1" \
    "$root/scripts/header-sources.rs"
}

case "${1:-}" in
  --check)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp/mscclpp.h"
    if ! diff -u "$root/include/mscclpp.h" "$tmp/mscclpp.h"; then
      echo "gen-header: include/mscclpp.h is out of date: run scripts/gen-header.sh" >&2
      exit 1
    fi
    echo "gen-header: include/mscclpp.h is up to date"
    ;;
  "")
    generate "$root/include/mscclpp.h"
    echo "gen-header: wrote include/mscclpp.h (cbindgen $CBINDGEN_VERSION)"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
