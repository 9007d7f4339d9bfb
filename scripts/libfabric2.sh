#!/usr/bin/env bash
# Builds libfabric 2.x from Debian's source package (trixie's, upstream release tarball as
# Debian ships it) into a cache, so that the library can be built and tested against it beside
# the system's 1.17:
#
#   scripts/libfabric2.sh          builds it if needed; prints the install prefix last, on stdout
#   scripts/libfabric2.sh --source OUT.tar.gz
#                                  writes the source tree, autogen'd (configure included), to
#                                  OUT.tar.gz instead: what scripts/gpu-check.sh builds with CUDA
#                                  on the GPU machine, which has no internet
#
# Only the providers that run on any machine are built (tcp, rxm, shm); the build takes a few
# minutes on 2 cores and is kept in $MSCCLPP_TOOLS_DIR (default ~/.cache/mscclpp-tools).
# Needs apt-get (Debian's archive: a private apt state is used, the system's sources and lists
# are not touched), and autoconf, automake, libtool, make and a C compiler (scripts/common.sh
# installs them). Logs go to stderr.
set -euo pipefail

VERSION=${MSCCLPP_LIBFABRIC2_VERSION:-2.1.0}
SUITE=${MSCCLPP_LIBFABRIC2_SUITE:-trixie}
tools=${MSCCLPP_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-tools}
prefix=$tools/libfabric-$VERSION

source_out=
if [[ ${1:-} == --source ]]; then
  source_out=$(realpath -m "${2:?--source needs an output file}")
elif [[ -f $prefix/lib/pkgconfig/libfabric.pc && -x $prefix/bin/fi_info ]]; then
  echo "$prefix"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
exec 3>&1 1>&2 # everything but the prefix goes to stderr

# A private apt state that knows only the deb-src line of $SUITE.
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial"
# deb822 format: apt reads it as such for the .sources extension.
cat >"$work/apt/src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
apt=(apt-get -q -o "Dir::Etc::SourceList=$work/apt/src.sources" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
  -o APT::Sandbox::User=root -o Acquire::Retries=3) # CI fetches on every run: ride out a hiccup
echo "libfabric2: fetching Debian's libfabric $VERSION source ($SUITE)"
"${apt[@]}" update >/dev/null
cd "$work"
# apt verifies each file's hash against the signed index before keeping it. The upstream
# tarball is what is built; the Debian packaging (.dsc, .debian.tar) is not needed, so a
# packaging file the mirror fails to serve does not stop the build.
if ! "${apt[@]}" source --download-only libfabric; then
  echo "libfabric2: apt-get source reported an error; going on if the upstream tarball arrived"
fi
tarball=$(ls libfabric_"$VERSION".orig.tar.* 2>/dev/null | head -1)
[[ -n $tarball ]] || { echo "libfabric2: no libfabric_$VERSION.orig.tar.* from $SUITE" >&2; exit 1; }
tar xf "$tarball"
cd "libfabric-$VERSION"
[[ -x configure ]] || ./autogen.sh >/dev/null
if [[ -n $source_out ]]; then
  cd ..
  tar czf "$source_out" "libfabric-$VERSION"
  echo "libfabric2: wrote $source_out"
  echo "$source_out" >&3
  exit 0
fi

echo "libfabric2: building into $prefix"
./configure -q --prefix="$prefix" --disable-static --enable-only \
  --enable-tcp=yes --enable-rxm=yes --enable-shm=yes >/dev/null
make -s -j"$(nproc)" >/dev/null
rm -rf "$prefix"
make -s install >/dev/null
"$prefix/bin/fi_info" -l | sed 's/^/libfabric2: provider /'
echo "$prefix" >&3
