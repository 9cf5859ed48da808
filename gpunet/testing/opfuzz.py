"""Fuzz every allowlisted op with argument grids, the way a hostile job would call it, and find the kernels that
crash the process instead of raising.

Each case goes through what a job goes through on a worker: the op's schema (arguments of the declared types), the
meta-device dry run (shape inference: most bad arguments are refused here, with an error), and, if the dry run
passes, the real kernel on CPU tensors. Real execution happens in a child process, so a segfault or abort is
recorded (op and arguments) instead of ending the fuzzer; the child is then replaced.

``scripts/fuzz_ops.py`` runs it from the command line; ``tests/test_op_fuzz.py`` runs a bounded version in CI, and
checks that every crash it finds is refused by the worker's argument guards (:mod:`gpunet.job.guards`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from gpunet.job.interpreter import nbytes

#: Skip real execution of a case whose dry run promises more than this (the fuzzer hunts crashes, not big kernels).
MAX_CASE_BYTES = 16 * 2**20

_SHAPES = [(), (0,), (1,), (3,), (2, 3), (0, 3), (3, 0), (2, 1, 3), (1, 2, 2, 2), (1, 1, 2, 2, 2)]
_DTYPES = [torch.float32, torch.int64, torch.bool, torch.float16, torch.int32]
_INTS = [-(2**31), -5, -1, 0, 1, 2, 3, 2**31 - 1, 2**40]
_INT_LISTS = [[], [0], [-1], [1], [2, 3], [0, 0], [-1, -1], [3, -2], [1, 1, 1], [2**31], [1, 2, 3, 4]]
_FLOATS = [0.0, -1.0, 0.5, 2.0, math.nan, math.inf, -math.inf, 1e30]
_NUMBERS = [0, -1, 3, 2.5, math.nan, True]
_STRINGS = ["none", "sum", "mean", "tanh", "floor", "trunc", "", "x" * 64]


@dataclass(frozen=True)
class Tensor:
    """A tensor argument, described so the child process can build it: shape, dtype, and how to fill it."""

    shape: tuple[int, ...]
    dtype: str
    fill: str  # "rand", "big" (out-of-range indices), "neg", "zeros"

    def build(self, device: str = "cpu") -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if device == "meta":
            return torch.empty(self.shape, dtype=dtype, device="meta")
        # The same values in every process and run (hash() of a str is salted per process).
        gen = torch.Generator().manual_seed(zlib.crc32(repr((self.shape, self.dtype, self.fill)).encode()) & 0xFFFF)
        if self.fill == "zeros":
            return torch.zeros(self.shape, dtype=dtype)
        if dtype.is_floating_point:
            base = torch.randn(self.shape, generator=gen)
            return (base * (1e6 if self.fill == "big" else 1) * (-1 if self.fill == "neg" else 1)).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, self.shape, generator=gen).bool()
        hi = 2**30 if self.fill == "big" else 2  # "rand" indices are in range of any dimension of 2 or more
        values = torch.randint(0, hi, self.shape, generator=gen)
        return (-values - 1 if self.fill == "neg" else values).to(dtype)

    def __repr__(self) -> str:
        return f"T{list(self.shape)}:{self.dtype}:{self.fill}"


@dataclass
class Crash:
    op: str
    args: list
    how: str


@dataclass
class Report:
    ops: int = 0
    cases: int = 0
    refused_by_dry_run: int = 0
    executed: int = 0
    raised: int = 0
    crashes: list[Crash] = field(default_factory=list)


def _values(arg_type: str, rng: random.Random) -> list[Any]:
    """Candidate values for one schema argument type."""
    optional = arg_type.startswith("Optional[")
    inner = arg_type[len("Optional["):-1] if optional else arg_type
    if inner == "Tensor":
        shapes = rng.sample(_SHAPES, 5)
        out = [Tensor(s, rng.choice(["float32", "int64", "bool", "float16", "int32"]), rng.choice(
            ["rand", "rand", "big", "neg", "zeros"])) for s in shapes]
        # Index-like tensors, where kernels that trust their arguments go wrong: empty, in range, out of range.
        out += [Tensor((0,), "int64", "rand"), Tensor((3,), "int64", "rand"), Tensor((3,), "int64", "big"),
                Tensor((3,), "int64", "neg"), Tensor((2, 3), "float32", "rand"), Tensor((4, 3), "float32", "rand")]
    elif inner == "List[Tensor]" or inner == "List[Optional[Tensor]]":
        out = [[Tensor(rng.choice(_SHAPES), "float32", "rand") for _ in range(n)] for n in (0, 1, 2)]
        out.append([Tensor((3,), "int64", "big")])
    elif inner == "int":
        out = list(_INTS)
    elif inner == "List[int]":
        out = [list(v) for v in _INT_LISTS]
    elif inner == "float":
        out = list(_FLOATS)
    elif inner == "List[float]":
        out = [[], [0.5], [2.0, 2.0], [-1.0, math.nan]]
    elif inner == "bool":
        out = [True, False]
    elif inner == "number":
        out = list(_NUMBERS)
    elif inner == "str":
        out = list(_STRINGS)
    elif inner == "Device":
        out = ["cpu"]
    else:
        out = []
    return out + [None] if optional else out


def grids(op: torch._ops.OpOverload, rng: random.Random) -> list[list[Any]]:
    """Candidate values for each positional argument of ``op`` (schema order) that the fuzzer generates."""
    out = []
    for arg in op._schema.arguments:
        if arg.kwarg_only and arg.has_default_value():
            break  # keyword-only extras (dtype=, layout=, ...) keep their defaults
        values = _values(str(arg.type), rng)
        if not values:
            break  # a type we do not generate: later arguments keep their defaults
        if arg.has_default_value():  # the default first: random calls pick it often (see draw)
            default = arg.default_value
            values = [default, *(v for v in values if v is not default and v != default)]
        out.append(values)
    return out


def draw(grid: list[list[Any]], op: torch._ops.OpOverload, rng: random.Random) -> list[Any]:
    """One random call: each argument that has a default keeps it half of the time (most kernels accept their
    defaults, so random calls get past the dry run often enough to find baselines)."""
    args = op._schema.arguments
    return [values[0] if args[i].has_default_value() and rng.random() < 0.5 else rng.choice(values)
            for i, values in enumerate(grid)]


def variations(baseline: list[Any], grid: list[list[Any]]) -> Iterator[list[Any]]:
    """``baseline`` (a call the kernel accepted) with one argument at a time set to each of its candidates: bad
    values reach the kernel next to otherwise good ones, where random combinations would be refused earlier."""
    for i, values in enumerate(grid):
        for value in values:
            if value is not baseline[i]:
                yield [*baseline[:i], value, *baseline[i + 1:]]


def _build(value: Any, device: str) -> Any:
    if isinstance(value, Tensor):
        return value.build(device)
    if isinstance(value, list):
        return [_build(v, device) for v in value]
    if value == "cpu" and device == "meta":
        return torch.device("meta")
    return value


def dry_run(op: torch._ops.OpOverload, args: list) -> bool:
    """Whether the meta-device dry run accepts the call (and its result is small enough to execute here)."""
    try:
        with torch.inference_mode():
            out = op(*_build(args, "meta"))
    except Exception:
        return False
    return nbytes(out) <= MAX_CASE_BYTES


def _child(conn) -> None:
    """Executes cases sent over ``conn`` on real CPU tensors; replies "ok" or "raised". A crash ends the process."""
    import signal

    from gpunet.job import guards
    from gpunet.job.validator import ALLOWED_OPS

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # kernels' own warnings (thousands of them) are not findings
    torch.set_num_threads(1)
    while True:
        try:
            name, args, guarded = conn.recv()
        except EOFError:
            return
        op = ALLOWED_OPS[name]
        try:
            with torch.inference_mode():
                built = _build(args, "cpu")
                if guarded:
                    guards.check(name, built)
                op(*built)
            conn.send("ok")
        except Exception:
            conn.send("raised")


class _Runner:
    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_child, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def run(self, name: str, args: list, guarded: bool, timeout: float = 30.0) -> str:
        """"ok", "raised", or how the process died (it is replaced)."""
        try:
            self.conn.send((name, args, guarded))
        except OSError:
            pass  # died on the previous case's way out: reported below
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
            how = f"hung over {timeout:.0f} s"
        else:
            how = ""
        self.proc.join(10)
        how = how or f"exit code {self.proc.exitcode}"
        self.conn.close()
        self._start()
        return f"crashed ({how})"

    def close(self) -> None:
        self.conn.close()
        self.proc.kill()
        self.proc.join(10)


def fuzz(ops: dict[str, torch._ops.OpOverload] | None = None, cases_per_op: int = 40, seed: int = 0,
         guarded: bool = True, baselines_per_op: int = 4) -> Report:
    """Fuzz ``ops`` (default: every allowlisted op): ``cases_per_op`` random calls, then each of up to
    ``baselines_per_op`` accepted calls varied one argument at a time. ``guarded``: apply the worker's argument
    guards first, as the worker does (a crash then is one a job could cause); False finds the raw kernels' crashes."""
    from gpunet.job.validator import ALLOWED_OPS

    ops = ALLOWED_OPS if ops is None else ops
    rng = random.Random(seed)
    report = Report()
    runner = _Runner()
    try:
        for name, op in sorted(ops.items()):
            report.ops += 1
            grid = grids(op, rng)
            seen: set[str] = set()
            baselines: list[list[Any]] = []

            def attempt(args: list[Any]) -> None:
                key = repr(args)
                if key in seen:
                    return
                seen.add(key)
                report.cases += 1
                if not dry_run(op, args):
                    report.refused_by_dry_run += 1
                    return
                outcome = runner.run(name, args, guarded)
                report.executed += 1
                if outcome == "raised":
                    report.raised += 1
                elif outcome == "ok":
                    if len(baselines) < baselines_per_op:
                        baselines.append(args)
                else:
                    report.crashes.append(Crash(name, args, outcome))

            for _ in range(cases_per_op):
                attempt(draw(grid, op, rng))
            # Accepted variations become baselines in turn (up to the cap): two bad values together are reached too.
            done = 0
            while done < len(baselines):
                for args in variations(baselines[done], grid):
                    attempt(args)
                done += 1
    finally:
        runner.close()
    return report


def replay(crashes: list[Crash], guarded: bool = True) -> list[str]:
    """Run recorded crash cases again (in a child process): "ok", "raised" or how it crashed, one per case."""
    runner = _Runner()
    try:
        return [runner.run(c.op, c.args, guarded) for c in crashes]
    finally:
        runner.close()
