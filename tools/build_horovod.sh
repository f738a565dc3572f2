#!/usr/bin/env bash
# Build Horovod 0.28.1 from its sdist for the torch of a virtualenv, and install it there.
#
#   tools/build_horovod.sh [PYTHON]      # `make horovod` runs it with .venv/bin/python
#
# Horovod is no longer released: 0.28.1 is the last version and comes as an sdist only. Its CMake
# files ask for C++14, while torch's headers need C++17 (torch 2.14: C++20): the build is patched
# to C++17, and its torch extension to the standard torch's headers ask for, before it starts. The ops are gloo on CPU; NCCL ops are built as well when the
# CUDA compiler, NCCL's headers and a GPU are all present (LOCKSTEP_HOROVOD_OPS=cpu|nccl forces
# one). Without NCCL ops, the CUDA part of Horovod is not built even when torch was built for CUDA.
#
# The wheel is cached in $LOCKSTEP_CACHE_DIR/horovod (default ~/.cache/lockstep/horovod), keyed
# by Horovod, torch and Python versions and the ops, so a second run only installs it (seconds).
# The build takes about 5 to 10 minutes on 2 cores; its log is kept next to the wheel.
set -euo pipefail

VERSION=0.28.1
SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
PY=${1:-.venv/bin/python}
CACHE=${LOCKSTEP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep}/horovod
OPS=${LOCKSTEP_HOROVOD_OPS:-auto}

fail() { echo "make horovod: $*" >&2; exit 1; }

[ -x "$PY" ] || fail "no Python at $PY: run make install first"
BIN=$(cd "$(dirname "$PY")" && pwd)
export PATH="$BIN:$PATH"  # a cmake installed with pip into the virtualenv is found first

# torch version, Python tag, whether CUDA/NCCL/a GPU are there: one line, space separated
read -r TORCH PYTAG CXX_STD CUDA_CC NCCL_HOME < <("$PY" - <<'EOF' 2>/dev/null
import os, re, shutil, sys
import torch
aten = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
found = re.search(r"C\+\+(\d+) or later", open(aten).read()) if os.path.exists(aten) else None
std = max(17, int(found.group(1))) if found else 17
cc = "-"
if torch.version.cuda and torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability(0)
    cc = f"{major}{minor}"
nccl = "-"
try:
    import nvidia.nccl  # the NCCL wheel torch depends on carries nccl.h
    nccl = list(nvidia.nccl.__path__)[0]
except ImportError:
    nccl = next((d for d in ("/usr/local/nccl", "/usr") if os.path.exists(f"{d}/include/nccl.h")), "-")
if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
    cc = "-"
print(torch.__version__, f"cp{sys.version_info[0]}{sys.version_info[1]}", std, cc, nccl)
EOF
) || fail "torch does not import with $PY: run make install first"

case "$OPS" in
  auto) if [ "$CUDA_CC" != "-" ] && [ "$NCCL_HOME" != "-" ]; then OPS=nccl; else OPS=cpu; fi ;;
  cpu) ;;
  nccl) [ "$NCCL_HOME" != "-" ] || fail "LOCKSTEP_HOROVOD_OPS=nccl but nccl.h was not found (pip install nvidia-nccl-cu12 or the nccl dev package)" ;;
  *) fail "LOCKSTEP_HOROVOD_OPS=$OPS: choose auto, cpu or nccl" ;;
esac
KEY="horovod-$VERSION-torch$TORCH-$PYTAG-$OPS"
DIR="$CACHE/$KEY"

installed_ok() {
  # the installed Horovod loads, was built against this torch, and has the ops asked for
  "$PY" - "$TORCH" "$OPS" <<'EOF' >/dev/null 2>&1
import json, os, sys
import horovod, horovod.torch as hvd
meta = json.load(open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")))
assert horovod.__version__ == "0.28.1" and meta.get("pytorch") == sys.argv[1]
assert hvd.gloo_built() and bool(hvd.nccl_built()) == (sys.argv[2] == "nccl")
EOF
}

show() {  # a path as a person would type it: relative to here, or under ~
  local path=${1#"$PWD/"}
  echo "${path/#"$HOME"/\~}"
}

if installed_ok; then
  echo "horovod $VERSION ($OPS ops) for torch $TORCH is already installed"
  exit 0
fi

WHEEL=$(ls "$DIR"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$WHEEL" ]; then
  CXX=${CXX:-$(command -v c++ || command -v g++ || true)}
  [ -n "$CXX" ] || fail "no C++ compiler found: install one (apt-get install g++) or set CXX"
  command -v cmake >/dev/null || fail "cmake not found: $BIN/pip install cmake (or apt-get install cmake)"
  cmake_version=$(cmake --version | head -n 1 | grep -Eo '[0-9]+\.[0-9]+' | head -n 1)
  [ "$(printf '%s\n3.13\n' "$cmake_version" | sort -V | head -n 1)" = 3.13 ] \
    || fail "cmake $cmake_version is older than 3.13: $BIN/pip install cmake"
  include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  [ -f "$include/Python.h" ] || fail "Python.h not found in $include: install the Python headers (apt-get install python3-dev)"

  mkdir -p "$CACHE"
  SDIST="$CACHE/horovod-$VERSION.tar.gz"
  if [ ! -f "$SDIST" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$CACHE" \
      || fail "could not download the horovod $VERSION sdist from PyPI"
  fi
  echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet - || fail "$SDIST does not have the expected sha256"

  WORK=$(mktemp -d "$CACHE/build.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  tar -xzf "$SDIST" -C "$WORK"
  SRC="$WORK/horovod-$VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt"
  sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $CXX_STD)/" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q "CMAKE_CXX_STANDARD $CXX_STD)" "$SRC/horovod/torch/CMakeLists.txt" \
    && ! grep -q 'CMAKE_CXX_STANDARD 14' "$SRC/CMakeLists.txt" || fail "the C++$CXX_STD patch did not apply"
  # Release, not Horovod's RelWithDebInfo: the same -O3 code without debug info, which takes a
  # third of the compile time with torch's headers
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$SRC/setup.py"
  grep -q "else 'Release'" "$SRC/setup.py" || fail "the Release build patch did not apply"
  env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
       HOROVOD_WITHOUT_MPI=1 "MAKEFLAGS=-j$(nproc)" "CXX=$CXX")
  if [ "$OPS" = nccl ]; then
    # CUDA 12 and later need C++17 in device code too; build kernels for the GPU that is here
    sed -i "s/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD $CXX_STD)/" "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
    env+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_NCCL_HOME=$NCCL_HOME" "HOROVOD_BUILD_CUDA_CC_LIST=$CUDA_CC")
  else
    # torch built for CUDA plus a CUDA toolkit on the machine make Horovod's CMake build its CUDA
    # half even when no GPU ops were asked for; a CPU build leaves it out
    sed -i '0,/string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)/s//&\nset(Pytorch_CUDA FALSE)/' \
      "$SRC/cmake/Modules/FindPytorch.cmake"
    grep -q '^set(Pytorch_CUDA FALSE)' "$SRC/cmake/Modules/FindPytorch.cmake" || fail "the CPU-only patch did not apply"
  fi

  LOG="$CACHE/$KEY.log"
  echo "make horovod: building horovod $VERSION ($OPS ops, C++$CXX_STD) for torch $TORCH; log in $(show "$LOG")"
  start=$(date +%s)
  env "${env[@]}" "$PY" -m pip wheel -v --no-deps --no-build-isolation "$SRC" -w "$WORK/wheel" >"$LOG" 2>&1 || {
    tail -n 20 "$LOG" >&2
    fail "the build failed (whole log: $(show "$LOG"))"
  }
  mkdir -p "$DIR"
  mv "$WORK"/wheel/horovod-*.whl "$DIR/"
  WHEEL=$(ls "$DIR"/horovod-*.whl | head -n 1)
  echo "make horovod: built in $(( $(date +%s) - start )) s"
fi

# --force-reinstall: a horovod of the same version built for another torch may be installed
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
"$PY" -m pip install -q "$WHEEL"  # its dependencies (cloudpickle, psutil, pyyaml, packaging)
installed_ok || fail "horovod was installed from $WHEEL but does not load: delete $DIR and run make horovod again"
echo "horovod $VERSION ($OPS ops) for torch $TORCH installed in $(show "$(dirname "$BIN")"); wheel cached in $(show "$DIR")"
