#!/usr/bin/env bash
# `cmake --install` and find_package(uckpt) from another project.
#   examples (default): the examples build against the package, train a few steps, save with
#                       client_state and resume
#   headers:            every installed header compiles on its own (one translation unit each)
# usage: install_test.sh SOURCE_DIR BUILD_DIR WORK_DIR [examples|headers]
set -euo pipefail
src=$(realpath "$1") build=$(realpath "$2") work=$3 what=${4:-examples}
fail() { echo "FAIL: $*" >&2; exit 1; }
case $what in
  examples) project=$src/examples/engine ;;
  headers) project=$src/tests/install/headers ;;
  *) fail "unknown part '$what': examples or headers" ;;
esac
rm -rf "$work"; mkdir -p "$work"; work=$(realpath "$work")

cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/uckpt/uckptConfig.cmake" || fail "no package config installed"
test -f "$work/prefix/include/uckpt/engine.h" || fail "no public header installed"
test -f "$work/prefix/include/uckpt/models/bert.h" || fail "no model header installed"

launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
name=$(basename "$project")
cmake -S "$project" -B "$work/build-$name" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
      "${launcher[@]}" > "$work/configure-$name.log" 2>&1 || { cat "$work/configure-$name.log"; fail "configure $name"; }
cmake --build "$work/build-$name" -j 2 > "$work/build-$name.log" 2>&1 || { tail -50 "$work/build-$name.log"; fail "build $name"; }
if [ "$what" = headers ]; then
  echo "install test: every installed header compiles on its own"
  exit 0
fi

cd "$work"
text=/usr/share/common-licenses/GPL-3
ex=$work/build-engine
OMP_NUM_THREADS=1 "$ex/train_gpt2" --text "$text" --steps 3 --checkpoint_every 2 --checkpoint_dir gpt2 > gpt2-a.log 2>&1 \
  || { cat gpt2-a.log; fail "train_gpt2"; }
test "$(cat gpt2/latest)" = global_step3 || fail "train_gpt2 did not save global_step3"
OMP_NUM_THREADS=1 "$ex/train_gpt2" --text "$text" --steps 5 --checkpoint_every 2 --checkpoint_dir gpt2 > gpt2-b.log 2>&1 \
  || { cat gpt2-b.log; fail "train_gpt2 resume"; }
grep -q "resumed from .*global_step3 at step 3" gpt2-b.log || { cat gpt2-b.log; fail "train_gpt2 did not resume from its client_state"; }
test "$(cat gpt2/latest)" = global_step5 || fail "train_gpt2 did not save global_step5"

OMP_NUM_THREADS=1 "$ex/train_bert_mlm" --text "$text" --steps 2 --checkpoint_dir bert > bert-a.log 2>&1 \
  || { cat bert-a.log; fail "train_bert_mlm"; }
OMP_NUM_THREADS=1 "$ex/train_bert_mlm" --text "$text" --steps 3 --checkpoint_dir bert > bert-b.log 2>&1 \
  || { cat bert-b.log; fail "train_bert_mlm resume"; }
grep -q "resumed from .*global_step2 at step 2" bert-b.log || { cat bert-b.log; fail "train_bert_mlm did not resume"; }
# A model built partitioned (uckpt::ZeroInit) at 2 ranks trains as the same model built whole.
test -x "$build/src/cli/uckpt" || fail "no uckpt binary in $build to launch train_partitioned with"
for how in partitioned whole; do
  flag=--whole
  if [ "$how" = partitioned ]; then flag=; fi
  OMP_NUM_THREADS=1 "$build/src/cli/uckpt" launch -n 2 --master_port 0 -- "$ex/train_partitioned" $flag > "$how.log" 2>&1 \
    || { cat "$how.log"; fail "train_partitioned ($how)"; }
done
grep -q "^built partitioned: rank 0 held" partitioned.log || { cat partitioned.log; fail "train_partitioned did not build partitioned"; }
test "$(grep -c '^step' whole.log)" = 3 || { cat whole.log; fail "train_partitioned --whole printed no 3 losses"; }
diff <(grep '^step' partitioned.log) <(grep '^step' whole.log) || fail "train_partitioned: the partitioned build's losses differ from the whole build's"
if "$ex/train_gpt2" --steps 1 > bad.log 2>&1; then fail "train_gpt2 without --text succeeded"; fi
grep -q -- "--text FILE is required" bad.log || { cat bad.log; fail "no clear error without --text"; }
echo "install test: headers compile alone, examples built against the package, trained, saved and resumed; a partitioned build trains as the whole one"
