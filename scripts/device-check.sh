#!/usr/bin/env bash
# Device check for any NVIDIA GPU machine, Jetson or not: runs scripts/device_check.py with what is
# installed here (nothing is installed). Prints each check as it runs; the JSON report's path is the
# last line. Exit 0 when no check failed (skipped ones are listed in the report), 1 otherwise.
#
#   scripts/device-check.sh [--out DIR] [--only CHECK ...] [--root DIR] [--quick]
#   scripts/device-check.sh --simulate RELEASE [--out DIR] [--only CHECK ...]
#
# --simulate: the same checks on a machine without a GPU, against the stand-ins of one modelled TensorRT
# release (8.6.1, 10.3.0, 11.1.0: tests/simulate/releases.py) in every process it starts; a quick run whose
# report says "simulated" and goes to out/device-check-simulated/. It tests the device check, not a device.
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
if [[ "${1:-}" == "--simulate" ]]; then
    shift
    exec "$python" -m tests.simulate.run "$@"
fi
exec "$python" "$repo/scripts/device_check.py" "$@"
