#!/usr/bin/env bash
# uckpt's programs and Python module use the one shared libstdc++.so.6 that PyTorch loads, and
# their C++ standard library calls bind to it, never to the copies of its parts that PyTorch's
# libraries carry and export (issue 38: a wheel's libtorch.so holds another GCC's std::filesystem
# and string streams; calls bound there, or a static libstdc++ beside the shared one, crashed).
# Every symbol is bound at start (LD_BIND_NOW) and the dynamic linker's record of each binding
# is read (LD_DEBUG=bindings).
# usage: std_bindings_test.sh PYTHON PYTHONPATH_OF_UCKPT PROGRAM...   (each PROGRAM run with --help)
set -uo pipefail
py=$1 pypath=$2; shift 2
fail=0
check() {  # NAME FILE LOG: FILE needs the shared libstdc++; no std:: symbol bound to a torch library
  local name=$1 file=$2 log=$3
  if ! readelf -d "$file" | grep -q 'NEEDED.*\[libstdc++\.so\.6\]'; then
    echo "FAIL: $name: links no shared libstdc++.so.6 (a static copy beside the one PyTorch loads)"; fail=1; return
  fi
  local bad
  bad=$(grep "binding file" "$log" |
        grep -E "to [^ ]*/(libtorch[^/ ]*|libc10[^/ ]*)\.so " | sed -n 's/.*symbol `\([^'"'"']*\).*/\1/p' |
        c++filt | grep '^std::' | sort -u)
  local total
  total=$(grep -c "binding file" "$log")
  if [ "$total" -lt 100 ]; then echo "FAIL: $name: only $total bindings recorded; LD_DEBUG gave nothing to check"; fail=1; return; fi
  if [ -n "$bad" ]; then
    echo "FAIL: $name: the C++ standard library bound to PyTorch's copies:"; echo "$bad" | head -20 | sed 's/^/  /'
    fail=1
  else
    echo "ok   $name: $total bindings, none of std:: to a torch library"
  fi
}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for prog in "$@"; do
  LD_BIND_NOW=1 LD_DEBUG=bindings LD_DEBUG_OUTPUT="$work/log" "$prog" --help > /dev/null 2>&1
  cat "$work"/log.* 2>/dev/null | grep "binding file $prog " > "$work/$(basename "$prog").log"; rm -f "$work"/log.*
  check "$(basename "$prog")" "$prog" "$work/$(basename "$prog").log"
done
LD_BIND_NOW=1 LD_DEBUG=bindings LD_DEBUG_OUTPUT="$work/log" PYTHONPATH="$pypath" "$py" -c "import torch, uckpt" > /dev/null 2>&1
cat "$work"/log.* > "$work/python.log" 2>/dev/null
grep "binding file [^ ]*_uckpt" "$work/python.log" > "$work/module.log"
module=$(PYTHONPATH="$pypath" "$py" -c "import torch, uckpt._uckpt as m; print(m.__file__)")
check "the Python module (_uckpt)" "$module" "$work/module.log"
exit $fail
