"""The user's handle on a computation: :class:`Job` traces it, ships it as plain data, and checks it locally with
exactly the worker's validator and interpreter (both sides share them; the worker never imports the client)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gpunet.job import tensors
from gpunet.job.checkpoints import StandIns
from gpunet.job.format import (
    DEFAULT_MAX_PROGRAM_BYTES,
    DimRange,
    Estimate,
    JobLimits,
    Manifest,
    ProgramParts,
    TensorSpec,
    WeightRef,
    canonical_json,
    check_batch,
    check_inputs,
    check_state,
    decode_outputs,
    nest_outputs,
    weights_start,
)
from gpunet.job.interpreter import run_program
from gpunet.job.trace import _FunctionModule, trace, trace_alike
from gpunet.job.validator import WorkerLimits, load_program

#: The client's own dry run (estimates, run_locally) checks what a worker does, with a worker's default limits except
#: two that depend on each worker's device and CPU: peak memory (a GPU's kernels need less than a CPU's) and the dry
#: run's time. Workers set their own limits (memory, FLOPs, sizes) too: a job over one is refused by that worker, with
#: the limit named.
_LOCAL_LIMITS = WorkerLimits(max_peak_memory_bytes=None, max_dry_run_seconds=float("inf"))


class Job:
    """A traced computation, safe to ship: manifest + JSON graph + safetensors weights. Build with from_module."""

    def __init__(self, parts: ProgramParts, manifest: Manifest | None = None):
        self.parts = parts
        self.manifest = manifest or Manifest.from_json(parts.manifest)
        self._program = None  # worker-side validated program, built on first run_locally/estimate
        self._meta_program = None  # the same with weights named by reference left meta: for estimates
        self._out_spec = None  # torch's TreeSpec of the outputs, when traced in this process: the very output types
        self._referenced: dict[str, memoryview] = {}  # the bytes of the weights named by reference, by sha256
        #: The checkpoint those weights come from (checkpoints.checkpoint_id), when named from one: workers that
        #: advertise it load them from disk, and routing prefers them.
        self.checkpoint: str | None = None
        self._stand_ins: StandIns | None = None  # traced from a checkpoint's stand-ins: its index reads their bytes

    # --- building ------------------------------------------------------------------------------------------------

    @classmethod
    def from_module(
        cls, module: torch.nn.Module, example_inputs: Sequence[torch.Tensor] = (), dynamic_shapes: Any = None,
        limits: JobLimits | None = None, example_kwargs: dict[str, torch.Tensor] | None = None, state: int = 0,
        stand_ins: StandIns | None = None, batch: str | None = None, trace_key: Any = None,
    ) -> "Job":
        """Trace ``module`` locally with torch.export (dynamic dims via ``torch.export.Dim``) into a Job.
        ``example_inputs``: a tuple of tensors, one per positional input (a single tensor is taken as a 1-tuple);
        ``example_kwargs``: keyword inputs (``input_ids=…, attention_mask=…``), passed to ``submit`` by name too.
        With keyword inputs, ``dynamic_shapes`` is a dict by input name. ``state``: the module is a stateful block,
        ``forward(x, *state) -> (y, *new_state)`` with this many state tensors (docs/sessions.md). ``stand_ins``:
        the module's weights include stand-ins for a checkpoint's tensors (no bytes here), named by reference.
        ``batch``: the name of the dynamic dim (first of every input, state included) whose rows are sessions that a
        worker may batch (Manifest.batch): the module computes each row from its own rows alone. ``trace_key``: the
        module is built alike with any other traced under this key in this process, whose graph it takes
        (:func:`gpunet.job.trace.trace_alike`)."""
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if trace_key is not None and not example_kwargs:
            t = trace_alike(trace_key, module, example_inputs, dynamic_shapes)
        else:
            t = trace(module, example_inputs, dynamic_shapes, example_kwargs)
        refs, weights = _stood_in(t, stand_ins)
        manifest = Manifest(
            torch_version=torch.__version__,
            ops=t.ops,
            inputs=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in t.inputs),
            outputs=tuple(TensorSpec(f"output_{i}", s["dtype"], tuple(s["shape"])) for i, s in enumerate(t.outputs)),
            output_structure=t.output_structure,
            dims={k: DimRange(v["min"], v["max"]) for k, v in t.dims.items()},
            limits=limits or JobLimits(),
            output_tree=t.output_tree,
            state=state,
            refs=refs,
            batch=batch,
        )
        if state or batch is not None:
            from gpunet.errors import JobRejected, UnsupportedProgram

            try:
                check_batch(batch, state, manifest.dims, manifest.inputs, manifest.outputs)
                check_state(state, manifest.inputs, manifest.outputs, manifest.output_structure, manifest.output_tree,
                            batch)
            except JobRejected as e:
                raise UnsupportedProgram(f"not a stateful block: {e.reason}") from None
        parts = program_parts(manifest.to_json(), canonical_json(t.graph), weights)
        job = cls(parts, manifest)
        job._out_spec = t.out_spec
        if refs:
            job._stand_ins, job.checkpoint = stand_ins, stand_ins.checkpoint
        return job

    @classmethod
    def from_function(cls, fn: Callable, example_inputs: Sequence[torch.Tensor], dynamic_shapes: Any = None, limits: JobLimits | None = None) -> "Job":
        """Like from_module for a plain function of tensors (no parameters)."""
        return cls.from_module(_FunctionModule(fn), example_inputs, dynamic_shapes, limits)

    def by_reference(self, known) -> "Job":
        """This job with every weight whose bytes ``known`` holds (a :class:`~gpunet.job.checkpoints.CheckpointIndex`
        of a checkpoint folder, or a set of sha256 hashes) named by its content hash instead of carried
        (docs/weights.md): a worker that has the checkpoint loads them from its own disk, and the client sends only
        those a worker finds nowhere else. The program hash changes (the manifest names the hashes); results do not."""
        carried = tensors.decode(self.parts.weights)
        refs, kept, referenced = [], {}, {}
        for name, t in carried.items():
            raw = tensors.raw_bytes(t)
            sha = hashlib.sha256(raw).hexdigest() if t.numel() else None
            if sha is not None and sha in known:
                refs.append(WeightRef(name, sha, tensors.DTYPE_NAMES[t.dtype], tuple(t.shape)))
                referenced[sha] = raw
            else:
                kept[name] = t
        if not refs:
            return self
        manifest = dataclasses.replace(self.manifest, refs=self.manifest.refs + tuple(refs))
        job = Job(program_parts(manifest.to_json(), self.parts.graph, kept), manifest)
        job._out_spec = self._out_spec
        job._referenced = {**self._referenced, **referenced}
        job._stand_ins = self._stand_ins
        job.checkpoint = getattr(known, "id", None) or self.checkpoint
        return job

    def referenced(self, sha: str) -> memoryview | None:
        """The bytes of a weight this job names by reference (None: not one of its own), for a worker that asks.
        WeightsNotHeld: one of its own that this machine holds only by hash (a slim checkpoint folder)."""
        found = self._referenced.get(sha)
        if found is None and self._stand_ins is not None and any(r.sha256 == sha for r in self.manifest.refs):
            found = self._stand_ins.read(sha)
            if found is None:
                from gpunet.errors import WeightsNotHeld

                raise WeightsNotHeld(f"weight {sha[:12]} is held here only by its hash (a slim checkpoint folder): "
                                     f"it runs on workers that keep checkpoint {self.checkpoint}, or fetch it from "
                                     "one that does")
        return found

    # --- bytes -----------------------------------------------------------------------------------------------------

    @property
    def program_hash(self) -> str:
        """Content hash of manifest + graph + weights (inputs are not part of it)."""
        return self.parts.hash

    def to_bytes(self) -> bytes:
        return self.parts.to_bytes()

    program_bytes = to_bytes  # what the worker caches under program_hash

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int = DEFAULT_MAX_PROGRAM_BYTES) -> "Job":
        """Parse container bytes (structure and manifest only; ops are checked when the job is validated)."""
        return cls(ProgramParts.from_bytes(data, max_bytes))

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> "Job":
        return cls.from_bytes(Path(path).read_bytes())

    # --- inputs and outputs ----------------------------------------------------------------------------------------

    @property
    def input_names(self) -> tuple[str, ...]:
        """The inputs in order, by name: ``submit(job, *args, **by_name)`` fills them (keyword inputs keep theirs)."""
        return tuple(spec.name for spec in self.manifest.inputs)

    def bind(self, args: Sequence = (), kwargs: dict | None = None) -> tuple[torch.Tensor, ...]:
        """Positional and named inputs as tensors in the job's input order (numpy arrays taken as they are), for
        ``submit`` and ``run_locally`` alike; UsageError, saying which, when they do not fit."""
        return tuple(_as_tensor(i, x) for i, x in enumerate(self._bind(args, kwargs)))

    def _bind(self, args: Sequence, kwargs: dict | None) -> tuple:
        from gpunet.errors import UsageError

        names = self.input_names
        if not kwargs:
            if len(args) != len(names):
                raise UsageError(f"the job takes {len(names)} input(s) ({', '.join(names)}), got {len(args)}: one "
                                 "positional argument per input it was traced with (or by name)")
            return tuple(args)
        if len(args) > len(names):
            raise UsageError(f"the job takes {len(names)} inputs ({', '.join(names)}), got {len(args)} positional")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise UsageError(f"the job has no input named {name!r} (its inputs: {', '.join(names)})")
            if name in bound:
                raise UsageError(f"input {name!r} given twice (by position and by name)")
            bound[name] = value
        missing = [n for n in names if n not in bound]
        if missing:
            raise UsageError(f"missing input(s): {', '.join(missing)}")
        return tuple(bound[n] for n in names)

    def encode_inputs(self, *inputs: torch.Tensor) -> bytes:
        """Inputs as safetensors bytes, after checking them against the manifest (JobRejected on a mismatch)."""
        check_inputs(self.manifest, inputs)
        return tensors.encode({f"input_{i}": t for i, t in enumerate(inputs)})

    def encode_step_inputs(self, *inputs: torch.Tensor) -> bytes:
        """A session step's inputs: all but the state, which stays on the worker (docs/sessions.md)."""
        check_inputs(self.manifest, inputs, without_state=True)
        return tensors.encode({f"input_{i}": t for i, t in enumerate(inputs)})

    def decode_step_outputs(self, data: bytes, expected=None) -> tuple[torch.Tensor, ...]:
        """A session step's outputs: all but the new state, which stays on the worker."""
        n = len(self.manifest.outputs) - self.manifest.state
        return tuple(decode_outputs(self.manifest, data, None if expected is None else expected[:n], without_state=True))

    def decode_outputs(
        self, data: bytes, expected: Sequence[tuple[str, tuple[int, ...]]] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The worker's output bytes as the module returned them: one tensor or a tuple. ``expected``: each output's
        (dtype, shape) as the dry run predicts them (``Estimate.outputs``), held exactly."""
        return self._nest(decode_outputs(self.manifest, data, expected))

    def _nest(self, outs: list[torch.Tensor]):
        """The flat outputs as the module returned them: a tensor, a tuple, or (``output_tree``) dicts, ModelOutputs
        and nested tuples, with their own types when traced in this process (else see ``nest_outputs``)."""
        if self.manifest.output_structure == "tensor":
            return outs[0]
        if self.manifest.output_tree is None:
            return tuple(outs)
        if self._out_spec is not None:
            from torch.utils._pytree import tree_unflatten

            return tree_unflatten(outs, self._out_spec)
        return nest_outputs(self.manifest.output_tree, outs)

    # --- local checks ------------------------------------------------------------------------------------------------

    def _validated(self):
        if self._program is None:
            self._program = load_program(self.parts, device="cpu", limits=_LOCAL_LIMITS,
                                         refs=lambda r: self.referenced(r.sha256) or b"")
        return self._program

    def _estimator(self):
        """The program for estimates: weights named by reference stay meta (nothing read for a dry run)."""
        if not self.manifest.refs:
            return self._validated()
        if self._meta_program is None:
            self._meta_program = load_program(self.parts, device="cpu", limits=_LOCAL_LIMITS, refs_as_meta=True)
        return self._meta_program

    def estimate(self, *inputs: torch.Tensor, **named: torch.Tensor) -> Estimate:
        """FLOPs and peak memory from the worker's dry run on meta tensors (same numbers the worker bills); inputs go
        by position or by name, as for :meth:`run_locally`."""
        return self._estimator().estimate(list(self.bind(inputs, named)))

    def run_locally(self, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run through exactly the worker's validation, dry run and interpreter, in this process, on CPU."""
        inputs = self.bind(inputs, named)
        prog = self._validated()
        data = self.encode_inputs(*inputs)
        return self._nest(run_program(prog, tensors.decode(data)))

    def __repr__(self) -> str:
        return f"Job(hash={self.program_hash[:12]}, op_kinds={len(self.manifest.ops)}, inputs={[s.shape for s in self.manifest.inputs]})"


def program_parts(manifest: bytes, graph: bytes, weights: dict[str, torch.Tensor]) -> ProgramParts:
    """A program's parts with its weights' data ALIGN-aligned within its container (format.weights_start). Within
    ALIGN bytes of a bin header's bounds (256 bytes, 64 KiB of weights) padding can flip the header's size back and
    forth: such a tiny program may stay misaligned, and its weights are copied at load as before."""
    encoded = b""
    for _ in range(4):  # padding can move the weights' length across a bin header's size (at 256 or 64 KiB bytes)
        start = weights_start(len(manifest), len(graph), len(encoded))
        if encoded and (start + 8 + int.from_bytes(encoded[:8], "little")) % tensors.ALIGN == 0:
            break
        encoded = tensors.encode(weights, start)
    return ProgramParts(manifest, graph, encoded)


def _as_tensor(i: int, x) -> torch.Tensor:
    """Input ``i`` as a tensor: a numpy array (or numpy scalar) as it is; UsageError for anything else."""
    from gpunet.errors import UsageError

    if not isinstance(x, torch.Tensor) and type(x).__module__ == "numpy" and hasattr(x, "__array__"):
        x = torch.from_numpy(x) if type(x).__name__ == "ndarray" else torch.as_tensor(x)
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"input {i} is a {type(x).__name__}; pass each input as a torch.Tensor (or numpy array), "
                         "one positional argument per input the job was traced with")
    return x


def _stood_in(t, stand_ins: StandIns | None) -> tuple[tuple[WeightRef, ...], dict[str, torch.Tensor]]:
    """A traced module's weights split into those named by reference (stand-ins for a checkpoint's tensors, under
    the program's own weight names) and those carried."""
    refs, carried = [], {}
    for name, w in t.weights.items():
        ref = stand_ins.ref_of(t.sources[name]) if stand_ins is not None else None
        if ref is not None:
            refs.append(dataclasses.replace(ref, name=name))
        elif stand_ins is not None and stand_ins.is_stand_in(w):
            from gpunet.errors import UnsupportedProgram

            raise UnsupportedProgram(f"weight {name} was computed from a checkpoint's weights the client does not "
                                     "hold (a tied or derived tensor): load the checkpoint whole")
        else:
            carried[name] = w
    return tuple(refs), carried
