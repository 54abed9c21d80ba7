#!/bin/bash
# The C++ side of where ranks come from and how they end (docs/python.md,
# "Running a script"), 2 CPU ranks of the tiny GPT-2:
#   1. `uckpt launch -n 2 uckpt train` ends cleanly: exit 0, no stack trace,
#      no "HeartbeatMonitor"/"TCPStore" line;
#   2. `uckpt train` started as mpirun starts it (Open MPI's variables only, no
#      RANK/WORLD_SIZE) trains one world of 2: one checkpoint with both ranks'
#      parts, where a world of one per process would write rank 0's part twice.
#
# usage: dist_launch_test.sh UCKPT WORK_DIR
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
tiny_gpt2 4
source "$(dirname "$(realpath "$0")")/ports.sh"
clean() {  # the log has no sign of a crash
  if grep -nE 'Traceback|Exception|HeartbeatMonitor|TCPStore|terminate called|Aborted' "$1"; then
    fail "$2: the output above is in $1"
  fi
}
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT

"$U" launch -n 2 --master_port 0 -- "$U" train $F --steps 3 --checkpoint_dir launched --run_name launched \
  > launched.log 2>&1 || { cat launched.log; fail "uckpt launch -n 2 uckpt train exited non-zero"; }
clean launched.log "uckpt launch -n 2 uckpt train"
echo "ok   uckpt launch -n 2 uckpt train: exit 0, no stack trace"

reserve_port port
for r in 0 1; do
  env OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$r OMPI_COMM_WORLD_LOCAL_SIZE=2 \
    MASTER_PORT=$port "$U" train $F --steps 3 --checkpoint_dir mpi --run_name mpi > mpi_$r.log 2>&1 &
  pids[$r]=$!
done
for r in 0 1; do wait ${pids[$r]} || { cat mpi_$r.log; fail "rank $r under Open MPI's variables exited non-zero"; }; done
clean mpi_0.log "rank 0 under Open MPI's variables"
clean mpi_1.log "rank 1 under Open MPI's variables"
tag=$(cat mpi/latest)
for r in 0 1; do
  ls mpi/$tag | grep -q "zero_pp_rank_${r}_mp_rank_00_optim_states.pt" ||
    fail "mpi/$tag lacks rank $r's optimizer part: $(ls mpi/$tag)"
done
echo "ok   uckpt train under Open MPI's variables: one world of 2 ($(ls mpi/$tag | tr '\n' ' '))"
