#!/usr/bin/env bash
# Device check for any NVIDIA GPU machine, Jetson or not: runs scripts/device_check.py with what is
# installed here (nothing is installed). Prints each check as it runs; the JSON report's path is the
# last line. Exit 0 when no check failed (skipped ones are listed in the report), 1 otherwise.
#
#   scripts/device-check.sh [--out DIR] [--only CHECK ...]
#
# Python: $PYTHON if set, else the repository's .venv (on Jetson create it with
# --system-site-packages so the system TensorRT binding is visible), else python3.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="$(command -v python3)"; fi
fi
cd "$repo"
if ! "$python" -c 'import engines, agent' 2>/dev/null; then
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # not installed: use the checkout itself
fi
exec "$python" "$repo/scripts/device_check.py" "$@"
