# Sourced by scripts/test and scripts/demo: create or refresh .venv.
# torch is pinned to 2.13.0 for development and CI: that exact CPU build lies on
# the machines' disk; any other spec pulls a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.nanhunt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/_venv.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" matplotlib
  touch "$stamp"
fi
