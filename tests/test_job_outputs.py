"""Models as users write them: outputs come back in the structure the module returned (dicts, OrderedDicts such as
Hugging Face's ModelOutput, named tuples, nested tuples/lists; the worker returns them flat and the client nests them
again), and inputs may be passed by keyword (``input_ids=…, attention_mask=…``)."""

from __future__ import annotations

import collections
import json
from typing import NamedTuple

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_structure

import gpunet
from gpunet.errors import JobRejected, UnsupportedProgram, UsageError
from gpunet.job.format import Manifest
from tests.swarm import wait_for


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Dicty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.linear(x)
        return {"logits": y, "extra": (y.sum(), [y * 2, Pair(y + 1, y - 1)])}


class Ordered(torch.nn.Module):
    def forward(self, x):
        return collections.OrderedDict(last_hidden_state=x * 2, pooler_output=x.mean(0))


@pytest.mark.parametrize("module", [Dicty().eval(), Ordered()], ids=["nested dict", "OrderedDict"])
def test_outputs_keep_the_modules_structure_locally_and_from_bytes(module):
    x = torch.randn(2, 4)
    job = gpunet.Job.from_module(module, example_inputs=(x,))
    with torch.no_grad():
        expected = module(x)
    mine = job.run_locally(x)
    assert tree_structure(mine) == tree_structure(expected)  # the very types, traced in this process
    for got, want in zip(tree_leaves(mine), tree_leaves(expected)):
        torch.testing.assert_close(got, want)
    shipped = gpunet.Job.from_bytes(job.to_bytes()).run_locally(x)  # a loaded job: dicts, named tuples, tuples
    assert list(shipped) == list(expected)
    for got, want in zip(tree_leaves(shipped), tree_leaves(expected)):
        torch.testing.assert_close(got, want)


def test_a_flat_output_keeps_its_old_manifest_and_hash():
    job = gpunet.Job.from_module(torch.nn.Linear(4, 3), example_inputs=(torch.randn(2, 4),))
    assert b"output_tree" not in job.parts.manifest


def test_unsupported_output_types_and_malformed_trees_are_refused_clearly():
    class Strange(torch.nn.Module):
        def forward(self, x):
            return {1: x}

    with pytest.raises(UnsupportedProgram, match="gpunet's converter .*string keys"):  # which step refused it
        gpunet.Job.from_module(Strange(), example_inputs=(torch.randn(2),))
    with pytest.raises(UnsupportedProgram, match="torch.export could not trace .*first of three steps"):
        gpunet.Job.from_module(Strange(), example_inputs=(torch.randn(3, 3), torch.randn(1)))  # one input too many
    job = gpunet.Job.from_module(Dicty().eval(), example_inputs=(torch.randn(2, 4),))
    manifest = json.loads(job.parts.manifest)
    for bad in (0, {"dict": [0, 1], "keys": ["a"]}, {"tuple": [0, 0, 1, 2, 3]}, {"tuple": [0], "list": [1]},
                {"dict": [0, 1, 2, 3, 4], "keys": ["a", "a", "b", "c", "d"]}, {"tuple": [0, 1, 2, 3, 9]},
                {"tuple": [0, 1, 2, 3, 4], "name": "not an identifier"}):
        with pytest.raises(JobRejected, match="output_tree"):
            Manifest.from_json(json.dumps({**manifest, "output_tree": bad}).encode())


class TextModel(torch.nn.Module):
    """Called the Hugging Face way: ``model(input_ids=…, attention_mask=…)``, returning a dict."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return {"last_hidden_state": h, "pooled": h.mean(1)}


def _text_job():
    seq = torch.export.Dim("seq", min=1, max=64)
    ids, mask = torch.randint(0, 50, (2, 5)), torch.ones(2, 5)
    job = gpunet.Job.from_module(TextModel().eval(), example_kwargs={"input_ids": ids, "attention_mask": mask},
                                 dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    return job


def test_keyword_inputs_are_traced_and_passed_by_name():
    torch.manual_seed(0)
    model = TextModel().eval()
    seq = torch.export.Dim("seq", min=1, max=64)
    ids, mask = torch.randint(0, 50, (2, 5)), torch.ones(2, 5)
    job = gpunet.Job.from_module(model, example_kwargs={"input_ids": ids, "attention_mask": mask},
                                 dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    assert job.input_names == ("input_ids", "attention_mask")
    longer_ids, longer_mask = torch.randint(0, 50, (2, 9)), (torch.rand(2, 9) > 0.5).float()
    got = job.run_locally(input_ids=longer_ids, attention_mask=longer_mask)
    with torch.no_grad():
        want = model(input_ids=longer_ids, attention_mask=longer_mask)
    torch.testing.assert_close(got["pooled"], want["pooled"])
    torch.testing.assert_close(job.run_locally(longer_ids, attention_mask=longer_mask)["pooled"], want["pooled"])
    with pytest.raises(UsageError, match="no input named 'mask'"):
        job.run_locally(input_ids=longer_ids, mask=longer_mask)
    with pytest.raises(UsageError, match="missing input"):
        job.run_locally(input_ids=longer_ids)
    with pytest.raises(UsageError, match="given twice"):
        job.run_locally(longer_ids, input_ids=longer_ids, attention_mask=longer_mask)


@pytest.mark.swarm
def test_a_dict_returning_model_comes_back_as_a_dict_from_the_network(swarm):
    swarm.start_worker()
    module = Dicty().eval()
    x = torch.randn(2, 4)
    job = gpunet.Job.from_module(module, example_inputs=(x,))
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=swarm.root / "client") as client:
        wait_for(lambda: client.workers(refresh=True), 30, "the worker")
        got = client.submit(job, x).result(timeout=60)
    with torch.no_grad():
        expected = module(x)
    assert tree_structure(got) == tree_structure(expected)
    for a, b in zip(tree_leaves(got), tree_leaves(expected)):
        torch.testing.assert_close(a, b)
    text = _text_job()
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=swarm.root / "client2") as client:
        ids, mask = torch.randint(0, 50, (2, 7)), torch.ones(2, 7)
        by_name = client.submit(text, input_ids=ids, attention_mask=mask).result(timeout=60)
        torch.testing.assert_close(by_name["pooled"], text.run_locally(ids, mask)["pooled"])
        mapped = list(client.map(text, [{"input_ids": ids, "attention_mask": mask}] * 3, progress=False))
        assert len(mapped) == 3 and all(torch.equal(m["pooled"], by_name["pooled"]) for m in mapped)


class _Pool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)


def _instance_norm():
    m = torch.nn.InstanceNorm2d(3, affine=True).eval()
    with torch.no_grad():
        m.weight.uniform_()
        m.bias.uniform_()
    return m


@pytest.mark.parametrize("make, x", [
    (lambda: (lambda x: 6 - x), torch.randn(2, 4)),  # scalar-first arithmetic (rsub)
    (lambda: (lambda x: torch.rsub(x, torch.ones(4), alpha=2)), torch.randn(2, 4)),
    (lambda: torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3)).eval(), torch.randn(2, 4)),
    (lambda: (lambda x: torch.linalg.vector_norm(x, ord=3, dim=-1)), torch.randn(2, 4)),
    (_instance_norm, torch.randn(2, 3, 5, 5)),
    (_Pool, torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)),  # ConvNeXt / Swin's head
], ids=["6 - x", "rsub tensor", "weight norm", "vector norm ord 3", "InstanceNorm2d", "channels-last pooling"])
def test_ops_that_blocked_model_families_now_trace_safely_and_match_eager(make, x):
    fn = make()
    job = (gpunet.Job.from_module(fn, example_inputs=(x,)) if isinstance(fn, torch.nn.Module)
           else gpunet.Job.from_function(fn, (x,)))
    assert not {"aten.as_strided.default", "aten.var_mean.correction"} & set(job.manifest.ops)
    with torch.no_grad():
        torch.testing.assert_close(job.run_locally(x), fn(x), rtol=1e-5, atol=1e-5)
