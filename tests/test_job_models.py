"""Round trips and output equality for the four model families, with dynamic batch (and sequence) sizes."""

from __future__ import annotations

import pytest
import torch

from gpunet import Job
from gpunet.job import cost
from tests._job_models import families

FAMILIES = {name: rest for name, *rest in families()}


def _flat(x):
    return list(x) if isinstance(x, tuple) else [x]


@pytest.fixture(scope="module")
def jobs():
    return {name: Job.from_module(m, ex, dynamic_shapes=dyn) for name, (m, ex, dyn, _) in FAMILIES.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_round_trip_keeps_program_and_hash(jobs, name, tmp_path):
    job = jobs[name]
    again = Job.from_bytes(job.to_bytes())
    assert again.program_hash == job.program_hash and len(job.program_hash) == 64
    job.save(tmp_path / "job.gpunet")
    assert Job.load(tmp_path / "job.gpunet").program_hash == job.program_hash


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_outputs_equal_eager_at_every_batch_size(jobs, name):
    module, example, _, others = FAMILIES[name]
    job = Job.from_bytes(jobs[name].to_bytes())  # exactly what a worker receives
    for x in [*example, *others]:
        with torch.inference_mode():
            ref = _flat(module(x))
        got = _flat(job.run_locally(x))
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert a.shape == b.shape and a.dtype == b.dtype
            if name == "encoder":  # eager takes PyTorch's fused fast path; the graph runs the same math unfused
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a, b), f"{name} at {tuple(x.shape)}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_outputs_bit_equal_to_the_exported_graph(name):
    """Same ops, same order, same kernels: the interpreter must match torch's own run of the decomposed graph."""
    module, example, dyn, others = FAMILIES[name]
    ep = torch.export.export(module, example, dynamic_shapes=dyn).run_decompositions()
    job = Job.from_module(module, example, dynamic_shapes=dyn)
    for x in others:
        with torch.inference_mode():
            ref = _flat(ep.module()(x))
        for a, b in zip(_flat(job.run_locally(x)), ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["mlp", "encoder", "convnet", "gpt"])
def test_bf16_outputs_within_dtype_tolerance(name):
    module, example, dyn, others = FAMILIES[name]
    module = module.to(torch.bfloat16)
    cast = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731
    try:
        job = Job.from_module(module, [cast(t) for t in example], dynamic_shapes=dyn)
        for x in map(cast, others):
            with torch.inference_mode():
                ref = _flat(module(x))
            for a, b in zip(_flat(job.run_locally(x)), ref):
                assert a.dtype == torch.bfloat16
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    finally:
        module.float()


def test_outputs_round_trip_through_bytes(jobs):
    from gpunet.job import tensors

    job = jobs["gpt"]
    out = job.run_locally(torch.randint(0, 50, (2, 5)))
    data = tensors.encode({f"output_{i}": t for i, t in enumerate(out)})
    back = job.decode_outputs(data)
    assert isinstance(back, tuple) and all(torch.equal(a, b) for a, b in zip(back, out))


def test_estimate_counts_flops_and_scales_with_batch(jobs):
    job = jobs["mlp"]
    e1, e4 = job.estimate(torch.randn(1, 16)), job.estimate(torch.randn(4, 16))
    matmuls = 2 * (16 * 32 + 32 * 32 + 32 * 4)  # three matmuls, 2 FLOPs per multiply-add
    activations = cost.TRANSCENDENTAL * 32 + cost.ELEMENTWISE * 32  # GELU, then ReLU: per element (gpunet.job.cost)
    assert e1.flops == matmuls + activations
    assert e4.flops == 4 * e1.flops
    assert e4.peak_memory_bytes > e1.peak_memory_bytes > 0


def test_from_function_traces_a_plain_function():
    job = Job.from_function(lambda a, b: (a @ b).relu(), (torch.randn(3, 4), torch.randn(4, 5)))
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(job.run_locally(a, b), (a @ b).relu())


def test_a_module_built_alike_takes_the_kept_graph_only_with_the_very_same_tensors(monkeypatch):
    """gpunet.job.trace.trace_alike (what causal_lm uses for its spans): a module under a key traced before takes that
    graph with its own weights, the program byte for byte a fresh trace's; one whose parameters or buffers differ
    in any way (another name, a tied pair untied, another layout), or one with a hook, is traced anew."""
    from gpunet.job import trace as tracing

    class Net(torch.nn.Module):
        def __init__(self, tied: bool = True, extra: bool = False):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            if tied:
                self.b.weight = self.a.weight
            if extra:
                self.c = torch.nn.Parameter(torch.zeros(8))
            self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) * self.scale

    x = torch.randn(2, 8)
    key = ("test", "Net")
    monkeypatch.setattr(tracing, "_traces", tracing.OrderedDict())
    traced = []
    real = tracing.trace
    monkeypatch.setattr(tracing, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))

    def job(module):
        return Job.from_module(module.eval(), (x,), trace_key=key)

    torch.manual_seed(1)
    job(Net())
    torch.manual_seed(2)
    second = Net()
    second.scale.fill_(3.0)  # a buffer outside the state dict is this module's too
    alike = job(second)
    assert len(traced) == 1
    with torch.no_grad():
        assert torch.equal(alike.run_locally(x), second(x))
    assert alike.program_hash == Job.from_module(second, (x,)).program_hash
    traced.clear()
    for other in (Net(tied=False), Net(extra=True)):
        assert torch.equal(job(other).run_locally(x), other(x).detach())
    assert len(traced) == 2
    hooked = Net()
    hooked.a.register_forward_hook(lambda module, args, out: out * 0)
    traced.clear()
    assert torch.equal(job(hooked).run_locally(x), hooked(x).detach())
    assert len(traced) == 1
