"""Outputs come back in the structure the module returned: dicts, OrderedDicts (Hugging Face's ModelOutput is one),
named tuples and nested tuples/lists. The worker returns them flat; the client nests them again."""

from __future__ import annotations

import collections
import json
from typing import NamedTuple

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_structure

import gpunet
from gpunet.errors import JobRejected, UnsupportedProgram
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

    with pytest.raises(UnsupportedProgram, match="string keys"):
        gpunet.Job.from_module(Strange(), example_inputs=(torch.randn(2),))
    job = gpunet.Job.from_module(Dicty().eval(), example_inputs=(torch.randn(2, 4),))
    manifest = json.loads(job.parts.manifest)
    for bad in (0, {"dict": [0, 1], "keys": ["a"]}, {"tuple": [0, 0, 1, 2, 3]}, {"tuple": [0], "list": [1]},
                {"dict": [0, 1, 2, 3, 4], "keys": ["a", "a", "b", "c", "d"]}, {"tuple": [0, 1, 2, 3, 9]},
                {"tuple": [0, 1, 2, 3, 4], "name": "not an identifier"}):
        with pytest.raises(JobRejected, match="output_tree"):
            Manifest.from_json(json.dumps({**manifest, "output_tree": bad}).encode())


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
