#!/usr/bin/env bash
# Set up gpunet in ./.venv on a fresh machine: Python 3.11+ and pip are all it needs.
# torch is pinned to the CPU build 2.13.0 first, so pip never pulls a multi-GB CUDA build here;
# on a GPU host, install the CUDA build of torch you want into .venv instead and skip that line.
set -euo pipefail
cd "$(dirname "$0")/.."
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

[ -x .venv/bin/python ] || python3 -m venv .venv
quiet .venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    quiet .venv/bin/python -m pip install -q "torch==2.13.0"
fi
# (setuptools warns, in a ten-line banner, that an editable install can be shadowed by a same-named folder: known.)
PYTHONWARNINGS="ignore:Editable installation" quiet .venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import gpunet, torch, hivemind; print('gpunet', gpunet.__version__, '| torch', torch.__version__, '| hivemind', hivemind.__version__)"
