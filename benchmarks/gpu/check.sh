#!/usr/bin/env bash
# kvtier's CUDA path checked and measured in one run; see check.py beside this for
# what each section does and docs/lab/gpu.md for the runs so far. Made for a
# one-GPU machine with torch and no network (a few minutes there), it also runs
# where there is no GPU: the CPU parts run and pass, the CUDA parts say skipped.
#
#   bash benchmarks/gpu/check.sh [--quick] [SECTION...]   # arguments go to check.py
#
# Steps: what is missing, wheels from .whl/ for it (installed under /tmp/kvtier-site
# only when an import fails), the C extensions built in place, the gpu-marked
# tests, then check.py. Environment: PYTHON (default python3), OUT (results:
# check.json), KVTIER_CHECK_BUILD=0 (use the extensions as they are),
# KVTIER_CHECK_PYTEST=0 (skip the gpu-marked tests), KVTIER_CHECK_TIMEOUT
# (seconds check.py may run, default 400).
#
#   bash benchmarks/gpu/check.sh --prebuild /path/to/python3.12
#
# builds the extensions for another Python into .whl/ext-<its EXT_SUFFIX>/, for a
# machine that cannot build them (no Python headers): check.sh copies them in
# place there when its own build fails.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

# The extensions of setup.py, built with gcc alone (no setuptools, no pip): a
# fallback where `setup.py build_ext` cannot run. Arguments: python, output root.
build_direct() {
    local py=$1 root=$2 inc suffix flags=(-O2 -shared -fPIC) ok=0
    inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])') || return 1
    suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') || return 1
    [ -f "$inc/Python.h" ] || { echo "  no Python.h under $inc"; return 1; }
    mkdir -p "$root/kvtier/manager" "$root/kvtier/transfer" "$root/kvtier/tiers"
    local xxh=() def=()
    if [ "$(uname -m)" = x86_64 ]; then
        xxh=(kvtier/tiers/_xxhash/xxh_x86dispatch.c); def=(-DKVTIER_XXH_DISPATCH=1)
    fi
    gcc "${flags[@]}" -std=c11 -I"$inc" kvtier/manager/_native.c \
        -o "$root/kvtier/manager/_native$suffix" || ok=1
    gcc "${flags[@]}" -std=c11 -I"$inc" kvtier/transfer/_address.c \
        -o "$root/kvtier/transfer/_address$suffix" || ok=1
    gcc "${flags[@]}" -std=gnu11 -I"$inc" kvtier/transfer/_copy.c -ldl \
        -o "$root/kvtier/transfer/_copy$suffix" || ok=1
    gcc "${flags[@]}" -std=gnu11 -I"$inc" kvtier/transfer/_gather.c -ldl \
        -o "$root/kvtier/transfer/_gather$suffix" || ok=1
    gcc "${flags[@]}" -std=c11 "${def[@]}" -I"$inc" kvtier/tiers/_blocks.c "${xxh[@]}" \
        -o "$root/kvtier/tiers/_blocks$suffix" || ok=1
    return $ok
}

if [ "${1:-}" = --prebuild ]; then
    py=${2:?--prebuild needs a python}
    suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') || exit 1
    dest=".whl/ext${suffix%.so}"
    rm -rf "$dest" && build_direct "$py" "$dest" && echo "built into $dest" && exit 0
    exit 1
fi

compiled_ok() {
    "$PY" -c 'import kvtier.manager._native, kvtier.transfer._address, kvtier.transfer._copy, kvtier.transfer._gather, kvtier.tiers._blocks' 2>/dev/null
}

echo "== what is here =="
echo "  $("$PY" --version 2>&1) at $(command -v "$PY"); gcc: $(command -v gcc || echo MISSING)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/  /'
missing=$("$PY" - <<'PYEOF'
import importlib
for m in ("numpy", "torch", "xxhash", "rich", "pydantic", "zmq", "pytest", "pytest_asyncio", "hypothesis"):
    try:
        importlib.import_module(m)
    except ImportError:
        print(m, end=" ")
PYEOF
)
if [ -n "$missing" ]; then
    echo "  missing: $missing"
    if ls .whl/*.whl >/dev/null 2>&1; then
        echo "  installing the wheels of .whl/ under /tmp/kvtier-site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/kvtier-site .whl/*.whl || status=1
        export PYTHONPATH=/tmp/kvtier-site${PYTHONPATH:+:$PYTHONPATH}
        if ! "$PY" -c 'import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) < (8, 4))' 2>/dev/null \
            && ls .whl/pytest/*.whl >/dev/null 2>&1; then
            echo "  pytest older than 8.4 (pytest-asyncio needs it): installing .whl/pytest/"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/kvtier-site .whl/pytest/*.whl || status=1
        fi
    else
        echo "  no wheels in .whl/ to install them from"
    fi
else
    echo "  every package kvtier and its tests import is here"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "${KVTIER_CHECK_BUILD:-1}" != 0 ]; then
    echo "== building the C extensions =="
    "$PY" setup.py --quiet build_ext --inplace 2>&1 | tail -20
    if ! compiled_ok; then
        echo "  setup.py did not build every extension: gcc directly"
        build_direct "$PY" .
    fi
    if ! compiled_ok; then
        suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
        if [ -d ".whl/ext${suffix%.so}" ]; then
            echo "  copying the prebuilt extensions of .whl/ext${suffix%.so}"
            cp -r ".whl/ext${suffix%.so}/kvtier" .
        fi
    fi
    compiled_ok && echo "  every extension imports" || { echo "  an extension does not import"; status=1; }
fi

if [ "${KVTIER_CHECK_PYTEST:-1}" != 0 ]; then
    echo "== gpu-marked tests =="
    mapfile -t files < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
    echo "  ${files[*]}"
    # A hang must not take the whole run: a minute per test, three for them all.
    timeout -k 10 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o timeout=60 "${files[@]}" 2>&1 | tail -25
    rc=${PIPESTATUS[0]}
    # 5: nothing selected ran (every gpu test skips without CUDA is fine; none at all is not)
    [ "$rc" = 0 ] || { echo "  pytest exited $rc"; status=1; }
fi

echo "== check.py =="
timeout -k 10 "${KVTIER_CHECK_TIMEOUT:-400}" "$PY" benchmarks/gpu/check.py "$@" || status=1
echo "check.sh: exit $status"
exit $status
