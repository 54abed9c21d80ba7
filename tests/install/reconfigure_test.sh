#!/usr/bin/env bash
# A build folder configured again for another Python's torch forgets the first torch: every
# path CMake cached inside it (Torch_DIR, TORCH_LIBRARY, the Python module's library) is
# looked up again in the second, so the build never links one torch's libraries and runs
# beside the other's. The second torch is the same files seen through another path: a venv
# whose site-packages holds a link to PYTHON's torch (its other packages through a .pth).
# usage: reconfigure_test.sh SOURCE_DIR PYTHON WORK_DIR
set -euo pipefail
src=$(realpath "$1") py=$2 work=$3
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
first=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')

python3 -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -s "$first" "$site/torch"
dirname "$first" > "$site/other_packages.pth"
second=$("$work/venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
[ "$second" = "$site/torch" ] || fail "the second Python's torch is $second, not $site/torch"

configure() {  # configure PYTHON LOG
  cmake -S "$src" -B "$work/build" -DPython3_EXECUTABLE="$1" -DUCKPT_TESTS=OFF -DUCKPT_BENCH=OFF \
    $(command -v ninja > /dev/null && [ ! -f "$work/build/CMakeCache.txt" ] && echo -G Ninja) > "$2" 2>&1 ||
    { cat "$2"; fail "cmake with $1"; }
}
cached() { grep -E "^$1:" "$work/build/CMakeCache.txt" | cut -d= -f2-; }

configure "$py" "$work/first.log"
case $(cached Torch_DIR) in "$first"/*) ;; *) fail "Torch_DIR is $(cached Torch_DIR), not in $first" ;; esac
echo "first: Torch_DIR $(cached Torch_DIR)"

configure "$work/venv/bin/python" "$work/second.log"
case $(cached Torch_DIR) in "$second"/*) ;; *) fail "after the second configure Torch_DIR is $(cached Torch_DIR), not in $second" ;; esac
case $(cached TORCH_LIBRARY) in "$second"/*) ;; *) fail "TORCH_LIBRARY is $(cached TORCH_LIBRARY), not in $second" ;; esac
if grep -F "=$first/" "$work/build/CMakeCache.txt"; then fail "paths in the first torch are still cached (above)"; fi
grep -F "uckpt: torch changed from $first to $second" "$work/second.log" || fail "the second configure does not say so"
echo "second: Torch_DIR $(cached Torch_DIR); nothing of $first cached"
rm -rf "$work"
