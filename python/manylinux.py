"""Gives a wheel built by `pip wheel ./python` the manylinux platform tag it meets (PEP 600).

    python3 python/manylinux.py WHEEL [OUT_DIR]

A locally built wheel is tagged `linux_x86_64` (any Linux, which PyPI refuses, and which says
nothing of the glibc it needs). PEP 600's `manylinux_2_X_<arch>` promises that the wheel works
with glibc 2.X or newer and needs nothing else of the system beyond the libraries every
manylinux system has. This checks both for every ELF file in the wheel:
  - the glibc it needs: the highest GLIBC_2.Y symbol version any of them asks for (readelf -V)
    gives X;
  - what it links: each NEEDED library is in the wheel (libfabric and the libraries it needs,
    which `_native.py` loads by path when the system has no libfabric 1.17 or newer) or on
    PEP 599's list of libraries every manylinux system provides.
Then it writes the wheel with that tag (`python -m wheel tags`, from the `wheel` package) into
OUT_DIR (default: the wheel's folder) and prints its path; it exits 1, saying why, when a
library is neither. Not auditwheel: `auditwheel repair` would rename the bundled libfabric and
point libmscclpp at the copy, where the package prefers the system's own libfabric (its
providers, built for the machine's NICs) and falls back to the copy.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# PEP 599's list (manylinux2014, kept by PEP 600), plus the dynamic loaders.
SYSTEM_LIBS = {
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libc.so.6",
    "libnsl.so.1",
    "libutil.so.1",
    "libpthread.so.0",
    "libresolv.so.2",
    "libX11.so.6",
    "libXext.so.6",
    "libXrender.so.1",
    "libICE.so.6",
    "libSM.so.6",
    "libGL.so.1",
    "libgobject-2.0.so.0",
    "libgthread-2.0.so.0",
    "libglib-2.0.so.0",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def readelf(args: list[str], path: Path) -> str:
    return subprocess.run(["readelf", "--wide", *args, str(path)], capture_output=True, text=True, check=True).stdout


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    wheel = Path(sys.argv[1])
    out_dir = Path(sys.argv[2]) if len(sys.argv) == 3 else wheel.parent
    m = re.match(r"(.+)-py3-none-linux_(x86_64|aarch64)\.whl$", wheel.name)
    if not m:
        print(f"{wheel.name}: expected a py3-none-linux_<arch> wheel (pip wheel ./python)", file=sys.stderr)
        return 2
    arch = m.group(2)
    glibc = (2, 17)  # manylinux2014's floor
    problems = []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.search(r"\.so(\.\d+)*$", n)]
        bundled = {Path(n).name for n in names}
        for n in names:
            path = Path(z.extract(n, tmp))
            for v in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", readelf(["-V"], path)):
                glibc = max(glibc, (int(v[0]), int(v[1])))
            for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf(["-d"], path)):
                if lib not in bundled and lib not in SYSTEM_LIBS:
                    problems.append(f"{n} links {lib}, which is neither in the wheel nor on PEP 599's list")
    if problems:
        print("not a manylinux wheel:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    tag = f"manylinux_{glibc[0]}_{glibc[1]}_{arch}"
    out_dir.mkdir(parents=True, exist_ok=True)
    src = wheel
    if out_dir.resolve() != wheel.parent.resolve():
        src = out_dir / wheel.name
        src.write_bytes(wheel.read_bytes())
    subprocess.run(
        [sys.executable, "-m", "wheel", "tags", "--platform-tag", tag, "--remove", str(src)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(out_dir / f"{m.group(1)}-py3-none-{tag}.whl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
