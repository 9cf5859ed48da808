#!/usr/bin/env python
"""Which models convert into gpunet jobs and match eager PyTorch: the zoo of gpunet.testing.zoo (Hugging Face
transformers text, vision and audio models, torchvision and timm models, at small random-init configs, and plain torch
modules), one row each.

    python scripts/model_coverage.py [--json] [--only NAME ...]      # in .venv: plain torch and transformers
    bash scripts/zoo_venv.sh && .venv-zoo/bin/python scripts/model_coverage.py   # with torchvision and timm too

A library that is not installed has its models left out (and said so).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunet.testing.zoo import models, try_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", nargs="*", help="model names to try")
    args = parser.parse_args()
    everything = models()
    zoo = [m for m in everything if not args.only or m.name in args.only]
    trials = []
    print(f"{'model':32} {'from':12} {'kind':7} {'result':9} {'seconds':>8}  detail")
    for model in zoo:
        o = try_model(model)
        trials.append(o)
        print(f"{o.name:32} {o.source:12} {o.kind:7} {o.stage:9} {o.seconds:8.1f}  {o.detail[:100]}", flush=True)
    ok = sum(o.ok for o in trials)

    def tally(attr: str) -> str:
        count = Counter((getattr(o, attr), o.ok) for o in trials)
        keys = sorted({getattr(o, attr) for o in trials})
        return ", ".join(f"{k} {count[(k, True)]}/{count[(k, True)] + count[(k, False)]}" for k in keys)

    missing = [lib for lib in ("transformers", "torchvision", "timm") if not any(m.source == lib for m in everything)]
    if missing:
        print(f"\n(left out, not installed here: {', '.join(missing)}; torchvision and timm live in .venv-zoo, "
              "see scripts/zoo_venv.sh)")
    print(f"\n{ok} of {len(trials)} convert and match eager (by kind: {tally('kind')}; by library: {tally('source')})")
    if args.json:
        print(json.dumps({"benchmark": "model_coverage", "ok": ok, "total": len(trials),
                          "models": [asdict(o) for o in trials]}))


if __name__ == "__main__":
    main()
