#!/bin/bash
# Ranks started by torchrun 2.x rendezvous through the store that torchrun's
# agent already serves on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): no
# rank may start its own store there, and every key goes under
# /worker/attempt_<TORCHELASTIC_RESTART_COUNT>/, as torch.distributed does.
# Debian's torchrun (1.13) does not run under Python 3.11, so the agent is
# played by a Python TCPStore server; 2 ranks train 3 steps with the heartbeat
# on, then the store must hold rank 0's heartbeat under the attempt prefix.
# Then the agent store is stopped and the ranks must refuse to start, naming it.
# usage: agent_store_test.sh UCKPT WORK_DIR
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
PY=${UCKPT_PYTHON:-/usr/bin/python3}
$PY -c 'import torch.distributed' 2> /dev/null || { echo "skip: $PY has no torch.distributed"; exit 77; }
tiny_gpt2 4 --heartbeat_interval 0.25 --heartbeat_timeout 5

# The agent: a store server on a free port until stop/ exists; then it checks
# the keys the ranks left and exits 0 (found) or 3.
cat > agent.py <<'PY'
import datetime, os, sys, time
import torch.distributed as dist
# Port 0: the server binds a port the kernel picks (a port chosen first could be taken meanwhile).
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
port = store.port
open("port", "w").write(str(port))
while not os.path.exists("stop"):
    time.sleep(0.1)
store.set_timeout(datetime.timedelta(seconds=2))
try:
    hb = int(store.get("/worker/attempt_3/uckpt_monitor/hb/0"))
    print(f"agent: rank 0's heartbeat under /worker/attempt_3/: {hb}")
    sys.exit(0 if hb > 0 else 3)
except Exception as e:
    print(f"agent: no heartbeat under /worker/attempt_3/: {e}")
    sys.exit(3)
PY
$PY agent.py > agent.log 2>&1 &
agent=$!
for i in $(seq 100); do [ -s port ] && break; sleep 0.1; done
[ -s port ] || { cat agent.log; fail "the agent store did not start"; }
port=$(cat port)

pids=()
for r in 0 1; do
  env RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RESTART_COUNT=3 \
    "$U" train $F --timeout 30 --steps 3 --run_name agent > "r$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}" || { cat r0.log r1.log; touch stop; fail "rank $r failed with torchrun's agent store"; }
done
[ "$(tail -n +2 logs/agent/metrics.csv | wc -l)" = 3 ] || fail "expected 3 logged steps"
touch stop
wait $agent || { cat agent.log; fail "the store has no heartbeat under the attempt prefix"; }
cat agent.log

# The agent is gone: the ranks must fail within the timeout, naming the store.
set +e
env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port TORCHELASTIC_USE_AGENT_STORE=True \
  timeout 60 "$U" train $F --steps 3 --timeout 3 --run_name gone > gone.log 2>&1
code=$?
set -e
[ $code -ne 0 ] && [ $code -ne 124 ] || { cat gone.log; fail "a rank without its agent store exited $code"; }
grep -q "rendezvous at 127.0.0.1:$port" gone.log || { cat gone.log; fail "the error does not name the store"; }
echo "agent store: 2 ranks trained through it; without it: $(grep -m1 -o 'rendezvous at.*' gone.log | cut -c1-100)"
