#!/usr/bin/env bash
# The rules a tool enforces (docs/architecture.md, "Rules the tools enforce"); `make test` runs this first.
#   ruff         a small rule set (pyproject.toml [tool.ruff]): undefined and unused names, syntax, a few bug patterns
#   lint-imports the layers and no import cycles (pyproject.toml [tool.importlinter])
#   mypy         the types of kernel/, engines/, agent/ and deploy/ (pyproject.toml [tool.mypy])
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
echo "lint: ruff" && "$VENV/bin/ruff" check --quiet .
echo "lint: import-linter"
if ! report=$("$VENV/bin/lint-imports" --no-cache 2>&1); then echo "$report"; exit 1; fi
echo "lint: mypy" && "$VENV/bin/mypy"
