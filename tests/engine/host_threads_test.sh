#!/bin/bash
# Host threads that fit the host (docs/engine.md, "Host threads"): 2 ranks
# under `uckpt launch` and under an environment-only launcher (torchrun's
# variables, nothing else); each rank's libtorch intra-op threads and uckpt's
# own pools stay within its share of the cores (cores / LOCAL_WORLD_SIZE)
# unless OMP_NUM_THREADS or --threads asks for more, and rank 0 says once
# what it chose. UCKPT_HOST_CORES=8 stands for an 8-core host on small machines.
#
# usage: host_threads_test.sh UCKPT PROBE LAUNCH_PY WORK_DIR
set -euo pipefail
U=$(realpath "$1")
PROBE=$(realpath "$2")
LAUNCH_PY=$3
W=$4
rm -rf "$W"
mkdir -p "$W"
cd "$W"
fail() { echo "FAIL: $*" >&2; exit 1; }
source "$(dirname "$(realpath "$0")")/ports.sh"
unset OMP_NUM_THREADS UCKPT_HOST_CORES UCKPT_LOAD_THREADS LOCAL_WORLD_SIZE LOCAL_SIZE

# probe NAME LAUNCHER [ENV...]: host_threads_probe at 2 ranks; output in NAME.log.
probe() {
  local name=$1 launcher=$2 port
  shift 2
  if [ "$launcher" = uckpt ]; then
    env "$@" "$U" launch -n 2 --master_port 0 -- "$PROBE" > "$name.log" 2>&1 || { cat "$name.log"; fail "$name: exit $?"; }
  else
    reserve_port port
    env "$@" /usr/bin/python3 "$LAUNCH_PY" 2 "$port" -c 'import os, sys; os.execv(sys.argv[1], sys.argv[1:])' \
      "$PROBE" > "$name.log" 2>&1 || { cat "$name.log"; fail "$name: exit $?"; }
  fi
}
# expect NAME N: both ranks report N threads for libtorch and every pool.
expect() {
  local name=$1 n=$2 r
  for r in 0 1; do
    grep -q "rank $r torch $n default $n worker $((n < 4 ? n : 4)) load $((n < 8 ? n : 8))\$" "$name.log" ||
      { cat "$name.log"; fail "$name: rank $r does not use $n host threads"; }
  done
}
# said NAME LINE: exactly one line of the log says LINE (after a launcher's prefix).
said() {
  [ "$(sed 's/^\[[0-9]*\] //' "$1.log" | grep -cxF -- "$2")" = 1 ] || { cat "$1.log"; fail "$1: not said once: $2"; }
}

for launcher in uckpt env; do
  probe "share_$launcher" $launcher UCKPT_HOST_CORES=8
  expect "share_$launcher" 4
  said "share_$launcher" \
    "uckpt: 4 host threads per rank (8 cores / 2 local ranks; set OMP_NUM_THREADS or EngineOptions::host_threads to change)"
  probe "omp_$launcher" $launcher UCKPT_HOST_CORES=8 OMP_NUM_THREADS=3
  expect "omp_$launcher" 3
done
# This machine's own cores (at most cores / 2: less where libtorch's default is
# smaller), and a launch restricted to one CPU.
cores=$(nproc)
probe host uckpt
for r in 0 1; do
  n=$(sed -n "s/^rank $r torch \([0-9]*\) .*/\1/p" host.log)
  [ -n "$n" ] && [ "$n" -ge 1 ] && [ "$n" -le $((cores / 2 > 1 ? cores / 2 : 1)) ] ||
    { cat host.log; fail "host: rank $r uses '$n' threads on $cores cores"; }
done
probe one_cpu uckpt taskset -c "$(taskset -cp $$ | sed 's/.*: *//; s/[,-].*//')"
expect one_cpu 1
said one_cpu "uckpt: 1 host thread per rank (1 core / 2 local ranks; set OMP_NUM_THREADS or EngineOptions::host_threads to change)"

# uckpt train: the share by default, --threads above it on request.
echo '{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}' > ds.json
F="--config ds.json --n_layer 1 --n_head 2 --n_embd 16 --vocab_size 97 --n_positions 16 --seq_len 16 --steps 2
   --log_dir logs --no_progress"
UCKPT_HOST_CORES=8 "$U" launch -n 2 --master_port 0 -- "$U" train $F > train.log 2>&1 || { cat train.log; fail "train"; }
said train "uckpt: 4 host threads per rank (8 cores / 2 local ranks; set OMP_NUM_THREADS or --threads to change)"
UCKPT_HOST_CORES=8 "$U" launch -n 2 --master_port 0 -- "$U" train $F --threads 5 > train5.log 2>&1 ||
  { cat train5.log; fail "train --threads 5"; }
said train5 "uckpt: 5 host threads per rank (--threads 5; above this rank's share of 4: 8 cores / 2 local ranks)"
OMP_NUM_THREADS=x "$U" train $F > bad_omp.log 2>&1 && fail "OMP_NUM_THREADS=x accepted"
grep -qF "OMP_NUM_THREADS='x': not a positive number" bad_omp.log || { cat bad_omp.log; fail "bad OMP_NUM_THREADS not named"; }
echo "host threads: OK"
