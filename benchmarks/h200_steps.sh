# Sourced by the GPU-node drivers (benchmarks/run.sh, benchmarks/h200_*.sh, benchmarks/train_beside.sh): each step's log, wall time and exit status, and setting (a value from config files).
# Sourced first, it also moves to the checkout (REPO), makes logs/h200/ and puts the checkout on
# PYTHONPATH: the node's own Python runs everything, eaglenest imported from this checkout.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
# snakemake on PATH, else the module (a node with the workflow's wheels on PYTHONPATH only)
command -v snakemake >/dev/null 2>&1 && SNAKEMAKE=${SNAKEMAKE:-snakemake} || SNAKEMAKE=${SNAKEMAKE:-python3 -m snakemake}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$REPO
mkdir -p "$REPO/logs/h200"
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
wait_for() { # file, seconds: until the file exists (status 1 when it never appears)
  local i
  for i in $(seq 1 "$2"); do [ -e "$1" ] && return 0; sleep 1; done
  return 1
}
setting() { # section key config files...: the value the last file that sets it gives
  python3 - "$@" <<'PY'
import sys, yaml
section, key, value = sys.argv[1], sys.argv[2], ""
for path in sys.argv[3:]:
    config = yaml.safe_load(open(path)) or {}
    scope = config if section == "-" else (config.get(section) or {})
    value = scope.get(key, value) or value
print(value)
PY
}
