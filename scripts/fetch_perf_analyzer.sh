#!/usr/bin/env bash
# Usage: fetch_perf_analyzer.sh [DIR]
# Puts Triton's perf_analyzer in DIR (default .cache/perf_analyzer) and prints the path of a
# wrapper that runs it; does nothing but print when it is already there.
#
# perf_analyzer is the standard load tool for Open Inference Protocol servers. No current package
# ships it for pip: the binary comes inside the tritonclient 2.41.0 wheel (later wheels dropped it;
# the 0.1.0 `perf-analyzer` on PyPI is a placeholder). It links libb64 (Debian's libb64-0d) and
# the CUDA runtime (PyPI's nvidia-cuda-runtime-cu12, loaded also on machines without a GPU), both
# fetched next to it; the wrapper points LD_LIBRARY_PATH at them. Nothing is installed system-wide
# and no root is needed.
set -euo pipefail

TRITONCLIENT_VERSION=2.41.0
CUDA_RUNTIME_VERSION=12.9.79
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.cache/perf_analyzer}"
WRAPPER="$DIR/perf_analyzer"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

if [[ -x "$WRAPPER" ]]; then
    echo "$WRAPPER"
    exit 0
fi
mkdir -p "$DIR/download" "$DIR/lib"
cd "$DIR/download"

"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d . \
    "tritonclient==$TRITONCLIENT_VERSION" "nvidia-cuda-runtime-cu12==$CUDA_RUNTIME_VERSION" >&2
"$PYTHON" - "$DIR" <<'PY'
import pathlib, shutil, sys, zipfile
target = pathlib.Path(sys.argv[1])
for wheel in pathlib.Path(".").glob("*.whl"):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            leaf = name.rsplit("/", 1)[-1]
            if name.endswith("/bin/perf_analyzer"):
                destination = target / "perf_analyzer.bin"
            elif leaf.startswith("libcudart.so"):
                destination = target / "lib" / leaf
            else:
                continue
            with archive.open(name) as source, destination.open("wb") as out:
                shutil.copyfileobj(source, out)
PY
chmod +x "$DIR/perf_analyzer.bin"

# A fresh image may have no package lists yet: read them once (as root) and try again.
if ! apt-get download libb64-0d >"$DIR/download/apt.log" 2>&1; then
    if [[ "$(id -u)" -eq 0 ]]; then
        apt-get update -q >>"$DIR/download/apt.log" 2>&1 || true
    fi
    apt-get download libb64-0d >>"$DIR/download/apt.log" 2>&1 || {
        tail -20 "$DIR/download/apt.log" >&2
        echo "fetch_perf_analyzer.sh: apt-get download libb64-0d failed" >&2
        exit 1
    }
fi
dpkg-deb -x libb64-0d_*.deb b64
cp b64/usr/lib/*/libb64.so.0d "$DIR/lib/"

cat >"$WRAPPER.tmp" <<SH
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$DIR/perf_analyzer.bin" "\$@"
SH
chmod +x "$WRAPPER.tmp"
"$WRAPPER.tmp" --version >&2
mv "$WRAPPER.tmp" "$WRAPPER"
rm -rf "$DIR/download"
echo "$WRAPPER"
