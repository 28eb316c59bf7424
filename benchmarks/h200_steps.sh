# Sourced by the H200 drivers (benchmarks/h200_*.sh): each step's log, wall time and exit status.
# Needs REPO (the checkout) and logs/h200/ under it.
stamp() { date -u +%FT%TZ; }
timed() { # name, command...: wall seconds and exit status into logs/h200/times.tsv
  local name=$1 start=$SECONDS rc
  shift
  echo "$(stamp) start $name" >>"$REPO/logs/h200/progress.log"
  "$@" >"$REPO/logs/h200/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$rc" >>"$REPO/logs/h200/times.tsv"
  echo "$(stamp) end $name rc=$rc" >>"$REPO/logs/h200/progress.log"
  return $rc
}
