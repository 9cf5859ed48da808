"""The vocabulary of a gpunet graph, shared by the client's tracer and the worker's validator.

A graph is JSON: ``{"inputs": [name...], "weights": [name...], "nodes": [node...], "outputs": [arg...]}`` where a
node is ``{"name": str, "op": str, "args": [arg...], "kwargs": {str: arg}}``. An ``op`` is an ATen overload named
``aten.<op>.<overload>`` or one of the few non-ATen names below. An ``arg`` is JSON null/bool/int/float/str, a list
of args, or a one-key object tagging a value that JSON cannot carry: ``{"ref": node}``, ``{"float": "inf"}``,
``{"dtype": "F32"}``, ``{"device": null}``, ``{"layout": "strided"}``, ``{"memory_format": "contiguous_format"}``.
Nothing in a graph is ever evaluated as code: every string is a key into a closed table.
"""

from __future__ import annotations

import math
import operator
import re

import torch

GRAPH_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")

_INT64_MAX = 2**63 - 1


def _bounded(fn):
    """Symbolic-size arithmetic stays in int64, so a chain of multiplications cannot grow a huge integer."""

    def wrapped(*args):
        out = fn(*args)
        if type(out) is not int or not -_INT64_MAX <= out <= _INT64_MAX:
            raise OverflowError(f"size arithmetic produced {str(out)[:40]}, outside int64")
        return out

    return wrapped


# Integer arithmetic on symbolic sizes (what torch.export emits as operator.* calls). Integers only.
SYM_OPS = {
    "sym.add": _bounded(operator.add),
    "sym.sub": _bounded(operator.sub),
    "sym.mul": _bounded(operator.mul),
    "sym.floordiv": _bounded(operator.floordiv),
    "sym.mod": _bounded(operator.mod),
    "sym.neg": _bounded(operator.neg),
    "sym.max": _bounded(max),
    "sym.min": _bounded(min),
}
SYM_OP_NAMES = {
    operator.add: "sym.add",
    operator.sub: "sym.sub",
    operator.mul: "sym.mul",
    operator.floordiv: "sym.floordiv",
    operator.mod: "sym.mod",
    operator.neg: "sym.neg",
    torch.sym_max: "sym.max",
    torch.sym_min: "sym.min",
}
GETITEM = "getitem"

SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last,
}
MEMORY_FORMAT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}
LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
