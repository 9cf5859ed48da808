#!/usr/bin/env python
"""Fuzz every allowlisted op with argument grids through the dry run and real execution in a child process, and
report the kernels that crash (segfault, abort, hang) instead of raising. See gpunet/testing/opfuzz.py.

    python scripts/fuzz_ops.py                      # guarded, as a worker runs jobs: expect no crashes
    python scripts/fuzz_ops.py --unguarded          # the raw kernels: what the guards are for
    python scripts/fuzz_ops.py --op aten._fft_r2c.default --cases 300 --baselines 20 --json

Exit status 1 when any case crashed. The CI test (tests/test_op_fuzz.py) runs a bounded sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=60, help="random calls per op (default 60)")
    parser.add_argument("--baselines", type=int, default=6, help="accepted calls per op varied one argument at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--op", action="append", help="only this op (repeatable), e.g. aten.gather.default")
    parser.add_argument("--unguarded", action="store_true", help="skip the worker's argument guards")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()

    from gpunet.job.validator import ALLOWED_OPS
    from gpunet.testing import opfuzz

    unknown = [name for name in args.op or [] if name not in ALLOWED_OPS]
    if unknown:
        parser.error(f"not allowlisted: {', '.join(unknown)}")
    ops = {name: ALLOWED_OPS[name] for name in args.op} if args.op else None
    started = time.perf_counter()
    report = opfuzz.fuzz(ops, cases_per_op=args.cases, seed=args.seed, guarded=not args.unguarded,
                         baselines_per_op=args.baselines)
    seconds = time.perf_counter() - started
    crashes = [{"op": c.op, "args": repr(c.args), "how": c.how} for c in report.crashes]
    if args.json:
        print(json.dumps({"ops": report.ops, "cases": report.cases, "refused_by_dry_run": report.refused_by_dry_run,
                          "executed": report.executed, "raised": report.raised, "crashes": crashes,
                          "guarded": not args.unguarded, "seconds": round(seconds, 1)}, indent=2))
    else:
        print(f"{report.ops} ops, {report.cases} cases in {seconds:.0f} s: {report.refused_by_dry_run} refused by "
              f"the dry run, {report.executed} executed ({report.raised} raised a clean error), "
              f"{len(crashes)} crashed{' (guards off)' if args.unguarded else ''}")
        for crash in crashes:
            print(f"  CRASH {crash['op']} {crash['args']}: {crash['how']}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
