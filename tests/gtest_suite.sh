#!/usr/bin/env bash
# One gtest suite as one CTest test (tests/gtest_suites.cmake registers them).
#   tests/gtest_suite.sh BINARY FILTER
# A process per case costs a second of loading libtorch, more than most cases take. The
# suite passes when every case passes; it is skipped (77) only when every case skipped. A
# case skipped beside passing ones fails the suite: ctest would report it passed, so such a
# suite must run case by case (ALONE in uckpt_gtest_suites, tests/CMakeLists.txt).
set -uo pipefail
bin=${1:?usage: gtest_suite.sh BINARY FILTER} filter=${2:?usage: gtest_suite.sh BINARY FILTER}
log=$(mktemp) || exit 1
trap 'rm -f "$log"' EXIT
"$bin" --gtest_filter="$filter" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || exit "$rc"
# Each finished case prints "[       OK ] Suite.Case (N ms)" or "[  SKIPPED ] Suite.Case (N ms)".
ran=$(grep -cE '^\[ +(OK|SKIPPED) \] [^ ]+ \([0-9]+ ms\)$' "$log")
skipped=$(grep -cE '^\[  SKIPPED \] [^ ]+ \([0-9]+ ms\)$' "$log")
if [ "$ran" = 0 ]; then
  echo "gtest_suite: no case of $bin matches $filter"
  exit 1
fi
[ "$skipped" = "$ran" ] && exit 77
if [ "$skipped" != 0 ]; then
  echo "gtest_suite: $skipped of the $ran cases of $filter skipped beside passing ones; CTest would report them" \
       "passed: add the suite to ALONE in uckpt_gtest_suites (tests/CMakeLists.txt) to run it case by case"
  exit 1
fi
