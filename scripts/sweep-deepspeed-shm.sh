#!/usr/bin/env bash
# Removes the host-memory buffers that real DeepSpeed's CPU all-reduce leaves in /dev/shm
# (deepspeed_allreduce_buffer_*, 64 MiB per rank and run: DeepSpeed 0.14.5 never unlinks them, and
# the tests run it on the CPU dozens of times). Only a buffer no running process maps and older than
# a minute goes, so a run in progress keeps its own. Prints how many were removed.
set -u
shopt -s nullglob
buffers=(/dev/shm/deepspeed_allreduce_buffer_*)
[ ${#buffers[@]} -eq 0 ] && { echo "sweep-deepspeed-shm: none"; exit 0; }
mapped=$(cat /proc/[0-9]*/maps 2> /dev/null | grep -o '/dev/shm/deepspeed_allreduce_buffer_[^ ]*' | sort -u)
removed=0
for f in "${buffers[@]}"; do
  grep -qxF "$f" <<< "$mapped" && continue
  [ -n "$(find "$f" -mmin +1 2> /dev/null)" ] || continue
  rm -f "$f" && removed=$((removed + 1))
done
echo "sweep-deepspeed-shm: removed $removed of ${#buffers[@]} DeepSpeed all-reduce buffer(s) in /dev/shm"
