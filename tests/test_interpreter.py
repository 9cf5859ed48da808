"""The compiled real run (gpunet.job.interpreter.Plan) against the generic loop it replaced: the same bits for every
model family and shape, the same refusals and errors naming the same node, the stop word and the pacer still
honoured before each node, and the generic loop where a program cannot be compiled."""

from __future__ import annotations

import time

import pytest
import torch

from gpunet import Job
from gpunet.errors import JobFailed, JobPreempted, JobTimeout
from gpunet.job import interpreter
from gpunet.job.interpreter import FAST_CALLS, Plan, Step, execute, run_program
from gpunet.job.validator import load_program
from gpunet.worker.executor.child import Pacer

from tests._job_models import families


def _generic(prog, inputs):
    with torch.inference_mode():
        return execute(prog.steps, prog.new_env(list(inputs)), prog.output_slots)


@pytest.mark.parametrize("family", families(), ids=lambda f: f[0])
def test_the_compiled_run_gives_the_generic_loops_bits_at_every_shape(family):
    name, module, example, dynamic, others = family
    prog = load_program(Job.from_module(module, example, dynamic_shapes=dynamic).program_bytes())
    for x in [*example, *others]:
        est = prog.estimate([x])
        pacer = Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() + 60)
        for stop, pace in [(None, None), (lambda: False, pacer)]:
            got = run_program(prog, [x], stop=stop, pace=pace)
            want = _generic(prog, [x])
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert torch.equal(g, w.contiguous()), name
    assert prog.plan(False, False) is not None and prog.plan(True, True) is not None


@pytest.mark.parametrize("op", sorted(FAST_CALLS))
def test_each_op_called_through_its_tensor_method_is_the_op(op):
    """Views and copies only: the same values, shape, strides and offset, and a view of the same storage."""
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    args = {
        "aten.view.default": ([4, 6],),
        "aten.permute.default": ([2, 0, 1],),
        "aten.expand.default": ([5, 2, 3, 4],),
        "aten.unsqueeze.default": (1,),
        "aten.squeeze.dim": (0,),
        "aten.t.default": (),
        "aten.transpose.int": (0, 2),
        "aten.select.int": (1, 2),
        "aten.split_with_sizes.default": ([1, 2], 1),
        "aten.clone.default": (),
    }[op]
    if op == "aten.t.default":
        x = x[0]
    if op == "aten.squeeze.dim":
        x = x[:1]
    name, overload = op.split(".")[1:]
    aten = getattr(getattr(torch.ops.aten, name), overload)
    want = aten(x, *args)
    got = FAST_CALLS[op](x, *args)
    # ... and with its arguments by name, as the validator allows (all but the tensor: see the next test)
    named = dict(zip([a.name for a in aten._schema.arguments[1:]], args))
    assert _same(FAST_CALLS[op](x, **named), aten(x, **named), x)
    assert _same(got, want, x)


def _same(got, want, x) -> bool:
    got, want = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride() and g.storage_offset() == w.storage_offset()
        assert (g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == (
            w.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())
    return True


def test_an_op_given_its_tensor_by_name_runs_as_the_generic_loop_runs_it():
    """A reviewer's program: aten.view with ``self`` as a keyword passes the validator and the dry run; a Tensor
    method takes its tensor positionally only, so the compiled run calls the op itself there (it failed as the
    worker's JobFailed: a client could make honest workers look faulty)."""
    import json

    from gpunet.job.format import ProgramParts, canonical_json

    w = torch.randn(3)
    job = Job.from_function(lambda x: x * 2 + w, (torch.randn(2, 3),))
    g, m = json.loads(job.parts.graph), json.loads(job.parts.manifest)
    g["nodes"].append({"name": "v", "op": "aten.view.default", "args": [],
                       "kwargs": {"self": {"ref": g["outputs"][0]["ref"]}, "size": [6]}})
    g["outputs"] = [{"ref": "v"}]
    m["ops"]["aten.view.default"] = str(torch.ops.aten.view.default._schema)
    m["outputs"][0]["shape"] = [6]
    prog = load_program(ProgramParts(canonical_json(m), canonical_json(g), job.parts.weights).to_bytes())
    x = torch.randn(2, 3)
    assert torch.equal(run_program(prog, [x])[0], _generic(prog, [x])[0])


def _gpt():
    name, module, example, dynamic, others = families()[-1]
    return load_program(Job.from_module(module, example, dynamic_shapes=dynamic).program_bytes()), example[0]


def test_the_stop_word_stops_a_compiled_run_before_its_first_node():
    prog, x = _gpt()
    asked = []

    def stop():
        asked.append(1)
        return True

    with pytest.raises(JobPreempted, match="higher lane"):
        run_program(prog, [x], stop=stop)
    assert asked == [1]


def test_the_pacer_stops_a_compiled_run_at_the_node_that_cannot_end_in_time():
    """(Its bounds themselves: tests/test_executor.py, on a clock the test turns.)"""
    prog, x = _gpt()
    est = prog.estimate([x])
    with pytest.raises(JobTimeout, match=rf"node {prog.steps[0].name!r} .*stopped before it ran") as e:
        run_program(prog, [x], pace=Pacer(prog.steps, est.node_flops, 1.0, time.monotonic()))  # no time left
    with pytest.raises(JobTimeout) as generic:
        with torch.inference_mode():
            execute(prog.steps, prog.new_env([x]), prog.output_slots,
                    pace=Pacer(prog.steps, est.node_flops, 1.0, time.monotonic()))
    assert str(e.value).split(", more than")[0] == str(generic.value).split(", more than")[0]


def test_a_failing_node_of_a_compiled_run_is_named_as_the_generic_loop_names_it(monkeypatch):
    prog, x = _gpt()
    victim = next(i for i, s in enumerate(prog.steps) if s.op == "aten.addmm.default")

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel this machine lacks")

    prog.estimate([x])  # (the dry run, on meta tensors, runs the op as it was)
    prog.steps[victim].fn = broken  # (before the plan is compiled: it binds the steps' ops then)
    with pytest.raises(JobFailed, match=rf"node {prog.steps[victim].name!r} \(aten.addmm.default\) raised "
                                        "RuntimeError: a kernel this machine lacks") as compiled:
        run_program(prog, [x])
    with pytest.raises(JobFailed) as generic:
        _generic(prog, [x])
    assert str(compiled.value) == str(generic.value)


def test_programs_that_cannot_be_compiled_run_by_the_generic_loop(monkeypatch):
    prog, x = _gpt()
    want = run_program(prog, [x])
    for bound, value in [("PLAN_MAX_STEPS", len(prog.steps) - 1), ("PLAN_MAX_TERMS", 2 * len(prog.steps))]:
        with monkeypatch.context() as m:  # too many nodes, or too much source (a list of 4,096 refs is 4,096 terms)
            m.setattr(interpreter, bound, value)
            prog._plans.clear()
            assert prog.plan(False, False) is None
            assert all(torch.equal(g, w) for g, w in zip(run_program(prog, [x]), want))
    # A keyword that is not an identifier is never written into the source (the validator allows only the op's
    # schema's names; this is the compiler's own check).
    step = Step("n", "aten.add.Tensor", torch.ops.aten.add.Tensor, 2, [None, None], {"alpha); import os; (": 1},
                arg_refs=[(0, 1), (1, 1)])
    with pytest.raises(ValueError, match="cannot be compiled"):
        Plan([step], [2], 2, False, False)


def test_a_compiled_run_stops_after_a_node_that_ran_past_what_its_work_allows():
    prog, x = _gpt()
    est = prog.estimate([x])
    pacer = Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() + 60)
    pacer.allowed = (-1.0,) * len(prog.steps)  # every node overran (the bounds: tests/test_executor.py)
    with pytest.raises(JobTimeout, match=rf"node {prog.steps[0].name!r} .* ran [0-9.]+ s; its counted work"):
        run_program(prog, [x], pace=pacer)


def test_bench_decoders_runs_a_hf_span_the_workers_way_and_matches_eager():
    """scripts/bench_decoders.py (issue 41's figure for the zoo's decoders) on its smallest setting: the span it
    builds as causal_lm does runs through the compiled plan and gives eager's outputs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_decoders.py"), "--families", "llama",
                           "--width", "1", "--length", "16", "--repeat", "3", "--json"],
                          capture_output=True, text=True, timeout=240, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["family"] for r in figures["families"]] == ["llama"]
    assert figures["all_outputs_match"], figures
    assert all(r["nodes"] > 100 and r["eager_ms"] > 0 for r in figures["families"])
