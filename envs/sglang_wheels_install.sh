#!/usr/bin/env bash
# Install the packed SGLang wheels on a node without a package index, then import-test.
#
#   bash envs/sglang_wheels_install.sh [ARCHIVE_DIR (.sglang-wheels)] [TARGET (/tmp/site)]
#
# ARCHIVE_DIR holds what envs/sglang_wheels_download.py wrote (<list name>-<i>.tar.xz,
# manifest.json). The workflow's own wheels (--list envs/workflow-node-wheels.txt) go into a
# TARGET of their own, with IMPORT_TEST=snakemake:
#   IMPORT_TEST=snakemake bash envs/sglang_wheels_install.sh .node-wheels /tmp/workflow-site
# Installs with `pip install --no-index --no-deps --target TARGET`, so nothing of the node's own Python changes: the server runs with PYTHONPATH=TARGET on top of
# the node's torch. Idempotent: an archive whose wheels are installed is skipped (stamps in
# TARGET/.eaglenest-installed). Exit status: 0 when every import works.
set -euo pipefail
ARCHIVES="${1:-.sglang-wheels}"
TARGET="${2:-/tmp/site}"
PY="${PYTHON:-python3}"
STAMPS="$TARGET/.eaglenest-installed"
UNPACK="$(mktemp -d "${TMPDIR:-/tmp}/sglang-wheels.XXXXXX")"
trap 'rm -rf "$UNPACK"' EXIT
mkdir -p "$TARGET" "$STAMPS"
# One install into TARGET at a time: a second waits, then finds the stamps and skips.
exec 9> "$TARGET/.eaglenest-install.lock"
flock 9
shopt -s nullglob
archives=("$ARCHIVES"/*-wheels-*.tar.xz)
[ ${#archives[@]} -gt 0 ] || { echo "no *-wheels-*.tar.xz in $ARCHIVES" >&2; exit 2; }
if [ -f "$ARCHIVES/manifest.json" ]; then  # the archives arrived whole
    "$PY" - "$ARCHIVES" <<'PY'
import hashlib, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for entry in json.loads((root / "manifest.json").read_text())["archives"]:
    digest = hashlib.sha256((root / entry["file"]).read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        sys.exit(f"{entry['file']}: sha256 {digest}, manifest says {entry['sha256']}")
print("archives match manifest.json")
PY
fi
for archive in "${archives[@]}"; do
    stamp="$STAMPS/$(basename "$archive").$(stat -c %s "$archive")"
    if [ -e "$stamp" ]; then echo "installed already: $archive"; continue; fi
    rm -rf "$UNPACK"/*
    tar -xJf "$archive" -C "$UNPACK"
    wheels=("$UNPACK"/*.whl)
    echo "installing ${#wheels[@]} wheels from $archive into $TARGET"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "${wheels[@]}" \
        2>&1 | grep -v "WARNING: Target directory" || true
    touch "$stamp"
done
# What the server imports first; sgl_kernel and flashinfer need a GPU driver to load fully.
MODULES="${IMPORT_TEST:-sglang sglang.srt.entrypoints.http_server sglang.srt.model_executor.model_runner sgl_kernel flashinfer sglang.srt.speculative.eagle_worker_v2 sglang.srt.models.llama_eagle3}"
# Side by side (each import alone takes seconds), reported in order.
declare -A import_pid
for module in $MODULES; do
    PYTHONPATH="$TARGET" timeout 300 "$PY" -c "import $module" > "$UNPACK/import-$module.log" 2>&1 &
    import_pid[$module]=$!
done
failed=0
for module in $MODULES; do
    if wait "${import_pid[$module]}"; then
        echo "import $module: ok"
    else
        echo "import $module: FAILED"; tail -n 5 "$UNPACK/import-$module.log"; failed=1
    fi
done
exit $failed
