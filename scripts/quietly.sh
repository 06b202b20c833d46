# shellcheck shell=bash
# Sourced, not run: `quietly LABEL COMMAND [ARGS...]` runs COMMAND (a program or a shell
# function) with its output in a log file and prints one line instead:
#
#   LABEL … done                      (the log is removed)
#   LABEL … failed, then the log's last 30 lines and its path on stderr; returns COMMAND's status
#
# Why: apt and dpkg print a line per package (hundreds on a fresh machine), which buries the
# demo's own steps; the log keeps them for when something goes wrong.
# WEIGHTROLL_VERBOSE=1 runs COMMAND with its own output instead (LABEL still printed first).

quietly() {
  local label=$1 log status=0
  shift
  if [ "${WEIGHTROLL_VERBOSE:-0}" = 1 ]; then
    printf '%s …\n' "$label"
    "$@"
    return
  fi
  log=$(mktemp "${TMPDIR:-/tmp}/weightroll-quietly.XXXXXX")
  printf '%s … ' "$label"
  "$@" >"$log" 2>&1 || status=$?
  if [ "$status" = 0 ]; then
    echo "done"
    rm -f "$log"
    return 0
  fi
  echo "failed"
  tail -n 30 "$log" >&2
  echo "(exit $status; full log: $log)" >&2
  return "$status"
}
