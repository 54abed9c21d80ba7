# Sourced by the shell tests that hand their ranks a rendezvous port.
# reserve_port VAR: sets VAR to a free TCP port that a background Python holds (SO_REUSEADDR, as
# c10d's store binds it) until this script ends: a port chosen and let go at once could be taken
# by a concurrent test's ranks first, and one test's ranks would join the other's store.
# Call it in the script's own shell, not in $(...): the holder watches its parent.
reserve_port() {
  local f
  f=$(mktemp)
  /usr/bin/python3 -c '
import os, socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.5)' < /dev/null > "$f" 2> /dev/null &
  local i
  for i in $(seq 200); do [ -s "$f" ] && break; sleep 0.05; done
  # A holder that could not bind (or no python3) would leave the file empty: fail, never wait forever.
  [ -s "$f" ] || { rm -f "$f"; echo "reserve_port: /usr/bin/python3 reserved no port within 10 s" >&2; return 1; }
  printf -v "$1" '%s' "$(cat "$f")"
  rm -f "$f"
}
