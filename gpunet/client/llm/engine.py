"""The engine behind a remote causal LM: the client's ends, the decoder layers as spans on workers, and generation
over sessions (one per row). The sync and async handles (:mod:`gpunet.client.llm.handles`) and the gateway drive it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import torch

from gpunet.client.routing import Requirements
from gpunet.client.sessions.session import SequentialCore, SessionCore, build
from gpunet.errors import UsageError, VerificationFailed
from gpunet.ledger.receipts import Receipt
from gpunet.client.llm import adapter, generation

logger = logging.getLogger("gpunet.llm")

#: A session's cache holds this many tokens when causal_lm is not told (nor the model's own limit is smaller).
DEFAULT_MAX_LENGTH = 2048
#: Idle seconds before workers free a generation's sessions (a request holds them only while it runs).
SESSION_TTL = 120.0
#: The most sessions a worker may batch into one forward of a span (the spans' batch dim's bound).
MAX_BATCH_ROWS = 64
#: A prompt goes to the spans in steps of at most this many tokens (see CausalLMCore._step).
PREFILL_CHUNK = 256
#: The most proposals a speculative step takes (so the most tokens a step can drop, the control channel's value):
#: small integers stay exact, and a shifted one far outside the checks' tolerance, in every dtype (bf16 included).
MAX_DRAFT_TOKENS = 8


@dataclass
class Usage:
    """What one request did: tokens in and out (per row), who served which span, and the receipts it paid."""

    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    placement: list[list[tuple[int, int, str | None]]] = field(default_factory=list)
    receipts: list[Receipt] = field(default_factory=list)
    output: torch.Tensor | None = None  # HF's generate output: the prompt as given, then the new tokens
    draft_proposed: int = 0  # speculative decoding: tokens a draft proposed, and those the model kept
    draft_accepted: int = 0

    @property
    def cost(self) -> float:
        """Credits paid for the request (every span step's receipt)."""
        from gpunet.ledger.receipts import NANO

        return sum(r.amount for r in self.receipts) / NANO


async def _all(coros) -> list:
    """Every coroutine's result, or the first error once the others are cancelled and ended: a row's session must not
    step on (and open sessions on workers) after the request failed and its sessions are being closed."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def load(path: str | Path, dtype: torch.dtype | None = None):
    """A checkpoint folder in HF layout (config.json, safetensors, tokenizer files): the model and its tokenizer,
    nothing fetched from any hub and no code from the folder run."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load, on a gateway's terminal or a demo's output
    path = check_folder(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False,
                                                 dtype=dtype if dtype is not None else "auto")
    return model, load_tokenizer(path)


def folder_index(core, folder: str | Path):
    """A checkpoint folder's tensors by content hash (the files transformers loads from it), their hashes kept in the
    client's data dir (one file per folder) so that opening it again reads only what changed."""
    import hashlib

    from gpunet.job.checkpoints import CheckpointIndex

    from gpunet.client.llm.skeleton import model_files

    folder = Path(folder).resolve()
    data_dir = getattr(core, "data_dir", None)
    cache = None
    if data_dir is not None:
        cache = Path(data_dir) / "checkpoints" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:24]}.json"
    return CheckpointIndex([folder], cache=cache, files=model_files(folder)).scan()


def need_transformers() -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UsageError("serving a language model needs transformers: pip install 'gpunet[llm]'")


def check_folder(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a checkpoint folder (no config.json there)")
    return path


def load_tokenizer(path: Path):
    """The folder's tokenizer, if it has one (None: generate takes and returns token ids)."""
    from transformers import AutoTokenizer

    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return None


def open_model(model_or_path, tokenizer=None, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a model object or a checkpoint folder, in ``dtype`` (a copy: the caller's model is
    left as it was)."""
    import copy

    need_transformers()
    if isinstance(model_or_path, (str, Path)):
        model, found = load(model_or_path, dtype)
        return model, tokenizer if tokenizer is not None else found
    model = model_or_path
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    return model, tokenizer


def _architecture(model, dtype: torch.dtype, max_length: int) -> tuple:
    """What a decoder's traced spans depend on besides gpunet's and transformers' code: its class, its whole
    configuration (not where it was read from) and attention implementation, its dtype and length. Two models alike
    so (the same folder opened again, another checkpoint of the same architecture) trace to the same graphs, which a
    span then takes from the first (gpunet.job.trace.trace_alike) instead of tracing again: seconds to minutes."""
    import json

    import transformers

    def private(config) -> dict:  # what the JSON leaves out: the attention and experts implementations chosen
        out = {}
        for k, v in vars(config).items():
            if hasattr(v, "to_json_string"):
                out[k] = private(v)
            elif k.startswith("_") and k != "_name_or_path" and isinstance(v, (str, int, float, bool, type(None))):
                out[k] = v
        return out

    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    # The code the layers run (the functions themselves: the key holds them, so no other takes their place): a
    # forward patched since, on a class or on one module, is another architecture.
    code = frozenset((type(m), type(m).forward, vars(m).get("forward")) for m in model.modules())
    return ("causal_lm", type(model).__module__, type(model).__qualname__, json.dumps(config, sort_keys=True),
            json.dumps(private(model.config), sort_keys=True), str(dtype), str(torch.get_default_dtype()),
            max_length, transformers.__version__, code)


class CausalLMCore:
    """A causal LM served by the swarm: embeddings and head here, decoder layers in spans on workers."""

    def __init__(self, core, model, tokenizer=None, *, max_length: int | None = None, spans: int | None = None,
                 requirements: Requirements | None = None, stand_ins=None):
        from torch.export import Dim

        if not hasattr(model, "config") or not hasattr(model, "generation_config"):
            raise UsageError("causal_lm takes a transformers causal LM (PreTrainedModel with a LM head) or the path "
                             f"of a checkpoint folder, got {type(model).__name__}")
        config = adapter.text_config(model.config)
        limit = getattr(config, "max_position_embeddings", None)
        self.max_length = int(max_length or min(limit or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH))
        if self.max_length < 2:
            raise UsageError(f"max_length must be at least 2, got {self.max_length}")
        if limit is not None and self.max_length > limit:  # past it, learned positions run out (GPT-2 at 1024)
            raise UsageError(f"max_length {self.max_length} is more than the model's max_position_embeddings "
                             f"({limit})")
        self.model, self.tokenizer, self.config = adapter.prepare(model), tokenizer, model.config
        self.ends = adapter.Ends(self.model)
        blocks = adapter.blocks_of(self.model, self.max_length)
        dtype = next(self.model.parameters()).dtype
        example = torch.zeros(1, 2, config.hidden_size + 1, dtype=dtype)  # (the control channel: adapter)
        # Rows are sessions (adapter.DecoderBlock computes each from its own): a worker may batch them.
        self.seq: SequentialCore = build(core, blocks, (example,), ({1: Dim("T", min=1, max=self.max_length)},),
                                         spans, None, requirements, stand_ins,
                                         rows=Dim("B", min=1, max=MAX_BATCH_ROWS),
                                         trace_key=_architecture(self.model, dtype, self.max_length))

    @classmethod
    def open(cls, core, model_or_path, *, tokenizer=None, dtype: torch.dtype | None = None, by_reference: bool = True,
             **kwargs) -> "CausalLMCore":
        """From a model object (borrowed: see adapter.Ends) or a checkpoint folder. A model loaded here from a folder
        keeps only its ends in memory once traced: its decoder layers' weights live in the spans' programs (sent to
        the workers, and again to a worker that takes over a span), so the client holds them once, not twice.
        ``by_reference`` (a folder): the spans name the checkpoint's tensors by content hash, so workers that keep
        the checkpoint load them from disk (a private model's never are: it carries its weights). Then the decoder
        layers are not even read: the model is built without them (:mod:`gpunet.client.llm.skeleton`) and the
        client's memory holds its ends only, when the checkpoint's tensors are the model's as they are."""
        requirements = kwargs.get("requirements")
        by_reference = by_reference and not (requirements is not None and requirements.private)
        index = None
        if isinstance(model_or_path, (str, Path)):
            need_transformers()
            path = check_folder(model_or_path)
            if by_reference:
                index = folder_index(core, path)
                lm = cls._open_thin(core, path, index, tokenizer, dtype, **kwargs)
                if lm is not None:
                    return lm
        model, tok = open_model(model_or_path, tokenizer, dtype)
        lm = cls(core, model, tok, **kwargs)
        if isinstance(model_or_path, (str, Path)):
            lm.ends.layers.to("meta")
            if index is not None:
                lm.name_weights_by_reference(index)
        return lm

    @classmethod
    def _open_thin(cls, core, path: Path, index, tokenizer, dtype, **kwargs) -> "CausalLMCore | None":
        """A folder's model with its decoder layers left on disk (None: it must be loaded whole, and is; a slim
        folder cannot be: UsageError)."""
        from gpunet.client.llm import skeleton

        listed = skeleton.weights_list(path)
        requirements = kwargs.get("requirements")
        if listed is not None and not set(listed) <= set(index.named()) and requirements is not None \
                and requirements.verify != "none":
            raise UsageError(f"{path} is a slim checkpoint folder: verify={requirements.verify!r} replays spans on "
                             "this machine, which needs their weights; use the whole checkpoint, or verify='none'")
        opened = skeleton.open_skeleton(path, dtype, index)
        if opened is None:
            return None
        try:
            return cls(core, opened.model, tokenizer if tokenizer is not None else load_tokenizer(path),
                       stand_ins=opened.stand_ins, **kwargs)
        except UsageError:
            raise
        except Exception as e:  # tracing from stand-ins failed where tracing the model itself may not
            skeleton.not_thin(path, index, listed, f"tracing its layers from stand-ins failed: {type(e).__name__}: "
                                                   f"{str(e)[:300]}")
            return None

    def name_weights_by_reference(self, index) -> None:
        """Each span names the weights it shares with the checkpoint's files (``index``, a CheckpointIndex of them)
        by their content hash instead of carrying them (docs/weights.md): a worker that keeps the checkpoint in its
        ``--models-dir`` loads them from its own disk, and only a worker that does not asks this client for them. A
        weight the spans hold in another dtype than the file's (``dtype=``) matches nothing, and is carried."""
        for span in self.seq.spans:
            span.job = span.job.by_reference(index)

    @property
    def spans(self):
        return self.seq.spans

    def steps_eos(self) -> tuple[int, ...]:
        """The tokens that end a generation by default (the model's generation config, else its tokenizer's)."""
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    # --- one forward pass ------------------------------------------------------------------------------------------

    async def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] as HF's forward gives them (each row on its own; padded positions get zeros)."""
        rows = generation.rows_of(input_ids, attention_mask, None, ())
        self._check_length(max(len(r) for r in rows))
        outs = await _all(self._forward_row(r) for r in rows)
        logits = torch.zeros(*input_ids.shape, outs[0].shape[-1], dtype=outs[0].dtype)
        for i, (row, out) in enumerate(zip(rows, outs)):
            logits[i, input_ids.shape[1] - len(row):] = out[0]
        return logits

    async def _forward_row(self, row: list[int]) -> torch.Tensor:
        ids = torch.tensor([row])
        h = await asyncio.to_thread(self.ends.embed, ids, torch.arange(len(row))[None])
        out = await self.seq.forward(adapter.with_control(h))
        return await asyncio.to_thread(self.ends.head, adapter.hidden_of(out))

    # --- generation ------------------------------------------------------------------------------------------------

    async def steps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    usage: Usage | None = None, draft=None, draft_tokens: int = 4,
                    **kwargs) -> AsyncIterator[torch.Tensor]:
        """Each step's next tokens [B], as HF's ``generate`` picks them (the whole output ends on ``usage.output``).
        One session per row, all rows stepping together. ``draft``: a small causal LM on this machine (same
        vocabulary) proposing ``draft_tokens`` tokens that one step checks at once (speculative decoding: the same
        tokens, fewer round trips; one row)."""
        usage = usage if usage is not None else Usage()
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if draft is not None:
            async for nxt in self._speculative_steps(input_ids, attention_mask, usage, draft, draft_tokens, kwargs):
                yield nxt
            return
        s = generation.settings(self.model.generation_config, input_ids.shape[1], self.max_length, **kwargs)
        rows = generation.rows_of(input_ids, attention_mask, s.pad_token_id, s.eos_token_id)  # (settings checked
        # the length: the prompt as given, padding included, as HF counts it)
        picker = generation.Picker(s, input_ids, self.tokenizer)
        usage.prompt_tokens = [len(r) for r in rows]
        sessions = [self.seq.session(ttl=SESSION_TTL) for _ in rows]
        seen = [len(r) for r in rows]
        try:
            logits = list(await _all(self._step(s_, row, 0) for s_, row in zip(sessions, rows)))
            while True:
                nxt = picker.pick(torch.stack(logits))
                usage.completion_tokens = list(picker.produced)
                yield nxt
                if picker.done:
                    break
                live = [i for i in range(len(rows)) if picker.stepping(i)]
                outs = await self._decode(sessions, live, nxt, seen)
                for i, out in zip(live, outs):
                    logits[i] = out
                    seen[i] += 1
        finally:
            usage.placement = [s_.placement for s_ in sessions]
            await asyncio.gather(*(s_.close() for s_ in sessions), return_exceptions=True)
            usage.receipts = [r for s_ in sessions for r in s_.receipts]
            usage.output = picker.ids

    async def _speculative_steps(self, input_ids, attention_mask, usage: Usage, draft, k: int,
                                 kwargs: dict) -> AsyncIterator[torch.Tensor]:
        """:meth:`steps` with a draft's proposals checked k at a time (gpunet.client.llm.speculative); ``input_ids``
        as steps made it, [B, n]."""
        from gpunet.client.llm.speculative import Draft

        if input_ids.shape[0] != 1:
            raise UsageError(f"speculative decoding takes one row (a prompt), got {input_ids.shape[0]}: generate "
                             "the others apart, or without a draft")
        if not 1 <= int(k) <= MAX_DRAFT_TOKENS:
            raise UsageError(f"draft_tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {k}")
        if isinstance(draft, (str, Path)):
            draft = load(check_folder(draft))[0]
        draft = draft if isinstance(draft, Draft) else Draft(draft, adapter.text_config(self.config).vocab_size)
        s = generation.settings(self.model.generation_config, input_ids.shape[1], self.max_length, **kwargs)
        row = generation.rows_of(input_ids, attention_mask, s.pad_token_id, s.eos_token_id)[0]
        picker = generation.Picker(s, input_ids, self.tokenizer)
        usage.prompt_tokens = [len(row)]
        session = self.seq.session(ttl=SESSION_TTL)
        context, seen = list(row), len(row)
        try:
            logits = (await self._step(session, row, 0))[None]  # what the next token is picked from (None: picked)
            rewind = 0  # proposals the spans wrote last step that were not kept
            while True:
                if logits is not None:
                    nxt = int(picker.pick(logits)[0])
                    usage.completion_tokens = list(picker.produced)
                    yield picker.ids[:, -1]
                    if picker.done:
                        return
                context.append(nxt)
                # As many proposals after it as the session's cache and the generation's length leave room for.
                room = min(k, self.max_length - seen - 1, s.max_new_tokens - picker.produced[0] - 1)
                # (the draft's torch work off the loop, as the ends': other requests' steps wait there)
                proposal = await asyncio.to_thread(draft.propose, context, room) if room > 0 else []
                every = await self._step(session, [nxt, *proposal], seen, rewind, every=True)  # [1 + room, vocab]
                seen += 1 + len(proposal)
                usage.draft_proposed += len(proposal)
                taken, logits = 0, None
                # Each proposal is kept while the picker picks it from the logits before it; the first pick that
                # differs is the next token itself (one draw per token, as without a draft).
                while taken < len(proposal):
                    nxt = int(picker.pick(every[taken:taken + 1])[0])
                    usage.completion_tokens = list(picker.produced)
                    yield picker.ids[:, -1]
                    if picker.done:
                        return
                    if nxt != proposal[taken]:
                        break
                    context.append(nxt)
                    taken += 1
                    usage.draft_accepted += 1
                else:  # every proposal kept: the next pick is from the logits after the last
                    logits = every[taken:taken + 1]
                rewind = len(proposal) - taken
                seen -= rewind
        finally:
            usage.placement = [session.placement]
            await session.close()
            usage.receipts = list(session.receipts)
            usage.output = picker.ids

    async def _decode(self, sessions: list[SessionCore], live: list[int], nxt: torch.Tensor, seen: list[int]
                      ) -> list[torch.Tensor]:
        """The next token's logits [vocab] for each ``live`` row, given its new token: the ends run once for all of
        them (one embedding forward and one head forward on this machine, not one of each per row: with many rows
        they were most of the client's time), each row's step through the spans in its own session."""
        ids = nxt[live][:, None]
        h = await asyncio.to_thread(self.ends.embed, ids, torch.tensor([[seen[i]] for i in live]))
        ys = await _all(self._through_spans(sessions[i], h[j:j + 1]) for j, i in enumerate(live))
        logits = await asyncio.to_thread(self.ends.head, torch.cat([y[:, -1:] for y in ys]))
        return list(logits[:, -1])

    async def _through_spans(self, session: SessionCore, h: torch.Tensor, rewind: int = 0) -> torch.Tensor:
        """Hidden states [1, T, H] through every span in one session step: the last span's hidden states."""
        x = adapter.with_control(h, rewind)
        y = await session.step(x)
        # Every span passes the control channel on as it came: one that changed it (to shift which tokens the
        # next spans keep, where checks would pass a small shift) is caught here, whoever it was.
        if not torch.equal(y[..., -1:], x[..., -1:]):
            raise VerificationFailed("a worker of this session changed its steps' control channel (which says "
                                     "how many tokens each span drops): the session's outputs are not trusted")
        return adapter.hidden_of(y)

    async def _step(self, session: SessionCore, tokens: list[int], seen: int, rewind: int = 0,
                    every: bool = False) -> torch.Tensor:
        """One row's new tokens in, the next token's logits [vocab] out (``every``: each new token's [T, vocab]):
        one session step, or for a prompt longer than PREFILL_CHUNK one per chunk, so that a worker batching other
        sessions' decode steps on the same span runs them between the chunks (a prompt stalls them one chunk's
        forward at a time, docs/sessions.md). ``rewind``: tokens the spans last wrote that are dropped first (``seen``
        counts without them)."""
        for at in range(0, len(tokens), PREFILL_CHUNK):
            part = tokens[at:at + PREFILL_CHUNK]
            # The ends are torch work (a big vocabulary's head is a large matmul): off the loop, where other
            # requests' steps and a gateway's streams wait.
            h = await asyncio.to_thread(self.ends.embed, torch.tensor([part]),
                                        torch.arange(seen + at, seen + at + len(part))[None])
            out = await self._through_spans(session, h, rewind if at == 0 else 0)
        logits = (await asyncio.to_thread(self.ends.head, out if every else out[:, -1:]))[0]
        return logits if every else logits[-1]  # (every: for a few tokens, one chunk)

    def _check_length(self, n: int) -> None:
        if n > self.max_length:
            raise UsageError(f"{n} prompt tokens are more than this model's max_length ({self.max_length}: "
                             "causal_lm(max_length=...) sets it)")

    async def generate(self, input_ids, attention_mask=None, streamer=None, usage: Usage | None = None,
                       **kwargs) -> torch.Tensor:
        """HF's ``generate`` output: the prompt as given, then the new tokens (pad after a row finished)."""
        usage = usage if usage is not None else Usage()
        if streamer is not None:
            first = torch.as_tensor(input_ids)
            streamer.put(first.cpu())
        try:
            async for nxt in self.steps(input_ids, attention_mask, usage=usage, **kwargs):
                if streamer is not None:
                    streamer.put(nxt.cpu())
        finally:
            if streamer is not None:
                streamer.end()
        return usage.output
