# Sourced by tests/polkit/run.sh and tests/systemd/run.sh: the agent's bus
# callers, as root or as a test user, through call.py (python3-dbus; see its
# header for the methods and what it prints).
#
#   IN    command prefix that enters where the system bus is: empty in the
#         polkit suite's namespace, "nspawn_exec.sh NAME" for the systemd
#         container
#   CALL  call.py's path there (readable by the test users)
#
#   as USER ARGS...          call.py ARGS as USER (root: as is); prints its
#                            last line, "OK ..." or "ERR <error name> <message>"
#   listen USER FILE SECS [MODE]
#                            call.py MODE SECS (default --signals) as USER in the background,
#                            output into FILE (on this side); returns once it
#                            has subscribed
#   wait_listeners FILE...   until each listener has printed its summary
#                            ("OK n=N members", at most 6 s)
# DENIED_MANAGE / DENIED_READ: what a caller polkit says no to gets.
DENIED_MANAGE='^ERR org\.freedesktop\.DBus\.Error\.AccessDenied .*org\.cube\.NetworkAgent\.manage'
DENIED_READ='^ERR org\.freedesktop\.DBus\.Error\.AccessDenied .*org\.cube\.NetworkAgent\.read'
IN=${IN:-}
as_user() {  # as_user USER CMD...: CMD as USER (its groups too), or as is for root
  local u=$1; shift
  if [ "$u" = root ]; then $IN "$@"
  else $IN setpriv --reuid="$u" --regid="$u" --init-groups env HOME=/ "$@"
  fi
}
as() { local u=$1; shift; as_user "$u" /usr/bin/python3 "$CALL" "$@" 2>&1 | tail -1; }
listen() {
  as_user "$1" /usr/bin/python3 "$CALL" "${4:---signals}" "$3" >"$2" 2>&1 &
  for _ in $(seq 250); do grep -q READY "$2" 2>/dev/null && return; sleep 0.02; done
}
wait_listeners() {
  local f i
  for f in "$@"; do
    for ((i = 0; i < 300; i++)); do grep -q '^OK n=' "$f" 2>/dev/null && break; sleep 0.02; done
  done
}
