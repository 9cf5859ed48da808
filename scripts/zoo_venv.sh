#!/usr/bin/env bash
# .venv-zoo: the model zoo's torchvision and timm, in an environment of their own that sees everything in .venv
# (gpunet, torch, transformers) and adds those two. Used by .ci/run for tests/test_model_zoo.py, and by hand:
#     bash scripts/zoo_venv.sh && .venv-zoo/bin/python scripts/model_coverage.py
# Why apart: PyPI's torchvision is a CUDA build. Beside a CPU torch its import fails ("operator torchvision::nms does
# not exist"), and transformers, which imports torchvision whenever it is installed, then loads no model at all.
# gpunet.testing.zoo.import_torchvision gets the zoo past that; nothing else in .venv should depend on it.
set -euo pipefail
cd "$(dirname "$0")/.."
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

[ -x .venv/bin/python ] || bash scripts/install.sh
[ -x .venv-zoo/bin/python ] || .venv/bin/python -m venv .venv-zoo  # the same interpreter as .venv
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# .venv's packages after .venv-zoo's own (addsitedir also reads .venv's .pth files: gpunet's editable install)
echo "import site; site.addsitedir('$(purelib .venv/bin/python)')" > "$(purelib .venv-zoo/bin/python)/_gpunet_venv.pth"
# The torchvision release built for this torch (torch 2.N pairs with torchvision 0.(N+15)): left to choose, pip would
# take the newest and replace torch to match it.
tv=$(.venv-zoo/bin/python -c 'import torch; print("0.%d.*" % (int(torch.__version__.split(".")[1]) + 15))')
quiet .venv-zoo/bin/python -m pip install -q "torchvision==$tv" "timm>=1.0"
.venv-zoo/bin/python -c "import gpunet.testing.zoo as z; z.import_torchvision(); import timm, torch; print('zoo env: torch', torch.__version__, '| timm', timm.__version__)"
