# Helpers shared by scripts/demo.sh and scripts/test.sh (sourced, not run).

# The Debian packages the build, the tests and the examples need.
# autoconf, automake, libtool, xz-utils: building libfabric 2.x from Debian's source
# (scripts/libfabric2.sh), whose index debian-archive-keyring verifies (Ubuntu lacks it).
# python3, python3-venv: the Python package's venv in scripts/test.sh.
MSCCLPP_APT_PACKAGES=(cmake make pkg-config g++ clang libclang-dev libfabric-dev libfabric-bin valgrind
  iproute2 autoconf automake libtool xz-utils debian-archive-keyring python3 python3-venv)

# Installs those of MSCCLPP_APT_PACKAGES that dpkg does not list as installed.
ensure_apt_packages() {
  local missing=() p sudo=()
  for p in "${MSCCLPP_APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  if ! command -v apt-get >/dev/null; then
    echo "missing packages ${missing[*]}, and no apt-get to install them: install them by hand" >&2
    return 1
  fi
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "need root or sudo to install ${missing[*]}" >&2; return 1; }
    sudo=(sudo)
  fi
  echo "installing ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}"
}

# cargo must exist already (rustup); this only finds it and adds rustfmt/clippy if asked.
ensure_cargo() { # [component...]
  if ! command -v cargo >/dev/null && [[ -x ${CARGO_HOME:-$HOME/.cargo}/bin/cargo ]]; then
    export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null; then
    echo "cargo not found: install the Rust toolchain first, with rustup (https://rustup.rs)," >&2
    echo "then run this again (cargo is looked for in PATH and in ~/.cargo/bin)" >&2
    return 1
  fi
  local c
  for c in "$@"; do
    case $c in
      rustfmt) cargo fmt --version >/dev/null 2>&1 && continue ;;
      clippy) cargo clippy --version >/dev/null 2>&1 && continue ;;
    esac
    command -v rustup >/dev/null || { echo "cargo has no $c and there is no rustup to add it" >&2; return 1; }
    rustup component add "$c" || return 1
  done
}

# Configures, builds and installs the CMake package: build_and_install BUILD_DIR PREFIX [ARGS...]
build_and_install() {
  local build=$1 prefix=$2
  shift 2
  cmake -S "$MSCCLPP_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$prefix" "$@" &&
    cmake --build "$build" --parallel "$(nproc)" &&
    cmake --install "$build"
}

# Builds c_examples against an installed package: build_examples BUILD_DIR PREFIX [ARGS...]
build_examples() {
  local build=$1 prefix=$2
  shift 2
  cmake -S "$MSCCLPP_ROOT/c_examples" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" "$@" &&
    cmake --build "$build" --parallel "$(nproc)"
}

# The installed package and the nccl-tests-style tools in build/perf (CUDA build where nvcc is
# found); prints the tools' directory: bin=$(build_perf_tools)
build_perf_tools() {
  { ensure_apt_packages && ensure_cargo; } >&2 || return 1
  build_and_install build/perf/cmake "$MSCCLPP_ROOT/build/perf/install" \
    -DMSCCLPP_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$MSCCLPP_ROOT/target}" -DMSCCLPP_BUILD_TESTS=OFF \
    >/dev/null || return 1
  build_examples build/perf/c_examples "$MSCCLPP_ROOT/build/perf/install" >/dev/null || return 1
  echo build/perf/c_examples
}
