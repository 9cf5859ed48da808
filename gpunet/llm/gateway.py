"""``gpunet gateway``: an OpenAI-compatible HTTP server over the swarm (aiohttp), so every ``openai`` client, chat UI
and agent framework can use a model the network serves.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template);
``stream: true`` as server-sent events the way OpenAI sends them (``data: {chunk}`` lines, then ``data: [DONE]``);
errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with its status codes. Each request
gets its own sessions (one per prompt); a client that disconnects mid-stream ends them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch
from aiohttp import web

from gpunet.errors import GpunetError, NoWorkersAvailable, UsageError
from gpunet.client.llm.engine import CausalLMCore, Usage

logger = logging.getLogger("gpunet.gateway")

#: OpenAI's defaults where a request says nothing.
DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 4 << 20
#: Requests generating at once (each holds a session per span, a full KV cache on each worker); more are answered 429.
DEFAULT_MAX_CONCURRENT = 16
#: Characters of prompt (all messages together) tokenized at most: tokenizing is CPU work, done off the loop.
MAX_PROMPT_CHARS = 1 << 20
#: A stop string is at most this long (each is looked for at every token).
MAX_STOP_CHARS = 256
#: Prompt tokens decoded before the completion's, so the first new token's text is what it is after the prompt (a
#: SentencePiece decoder strips a leading space from a text's start).
DECODE_CONTEXT = 4
_LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One completion request, checked: the prompt's token ids and the generation arguments."""

    prompt_ids: list[int]
    max_tokens: int
    kwargs: dict
    stop: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, lo: float, hi: float, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be a {'integer' if kind is int else 'number'}", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return kind(value)


class Gateway:
    def __init__(self, lm: CausalLMCore, model_name: str, api_key: str | None = None,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT, draft=None, draft_tokens: int = 4):
        """``draft``: a small causal LM (same vocabulary) whose proposals each request's steps check several at a
        time (speculative decoding, docs/llm.md: the same text, fewer round trips through the spans)."""
        if lm.tokenizer is None:
            raise UsageError("the gateway needs the model's tokenizer (tokenizer files in the checkpoint folder)")
        self.lm, self.model_name, self.api_key = lm, model_name, api_key
        self.speculative = {"draft": draft, "draft_tokens": draft_tokens} if draft is not None else {}
        self.max_concurrent, self.running = max_concurrent, 0
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    # --- plumbing --------------------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            self._admit(request)
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status == 404:
                return web.json_response(ApiError(404, f"Unknown path {request.path}", code="not_found").body(),
                                         status=404)
            if e.status == 405:
                return web.json_response(ApiError(405, f"{request.method} is not allowed on {request.path}").body(),
                                         status=405)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug of ours: said in OpenAI's shape, and in the log
            logger.exception("Request %s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error").body(),
                                     status=500)

    def _admit(self, request: web.Request) -> None:
        """The key, when one is set; without one, only requests a web page cannot forge (a browser on this machine
        visiting a hostile page can POST text/plain to 127.0.0.1, and DNS rebinding can name it by another host)."""
        if self.api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")
            return
        host = (request.host or "").rsplit(":", 1)[0] if not (request.host or "").startswith("[") else \
            (request.host or "").split("]")[0] + "]"
        if host not in _LOOPBACK_NAMES:
            raise ApiError(403, f"Host {request.host!r} refused: without --api-key this gateway answers only requests "
                           "addressed to 127.0.0.1 or localhost", code="forbidden_host")

    async def _body(self, request: web.Request) -> dict:
        if request.content_type != "application/json":
            raise ApiError(415, "the request body must be JSON (Content-Type: application/json)")
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes") from None
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist (this gateway serves '{self.model_name}')",
                           param="model", code="model_not_found")
        return body

    def _model_obj(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "gpunet"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_obj()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise ApiError(404, f"The model '{request.match_info['model']}' does not exist", param="model",
                           code="model_not_found")
        return web.json_response(self._model_obj())

    # --- requests ----------------------------------------------------------------------------------------------------

    def _request(self, body: dict, prompt_ids: list[int]) -> Request:
        for name in ("n", "best_of"):
            if body.get(name, 1) not in (1, None):
                raise ApiError(400, f"'{name}' must be 1 (one completion per request)", param=name)
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias",
                     "response_format", "tool_choice", "function_call"):
            if body.get(name) not in (None, False, {}, []):
                raise ApiError(400, f"'{name}' is not supported by this gateway", param=name)
        for name in ("presence_penalty", "frequency_penalty"):
            if _number(body, name, 0.0, -2.0, 2.0):
                raise ApiError(400, f"'{name}' is not supported (only 0); use 'repetition_penalty'", param=name)
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(limit_name)
        room = self.lm.max_length - len(prompt_ids)
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.lm.max_length} tokens. However, "
                           f"your prompt has {len(prompt_ids)} tokens.", param="messages", code="context_length_exceeded")
        max_tokens = room if limit is None and "messages" in body else DEFAULT_MAX_TOKENS if limit is None else \
            _number(body, limit_name, None, 1, 1 << 30, int)
        if max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.lm.max_length} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens} for the completion).", param="max_tokens", code="context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "top_k": 0}
        if temperature < 1e-5:  # as good as greedy (and 1/temperature would overflow the logits)
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
                raise ApiError(400, "'seed' must be a 64-bit integer", param="seed")
            kwargs["seed"] = seed
        penalty = _number(body, "repetition_penalty", 1.0, 0.01, 10.0)
        if penalty != 1.0:
            kwargs["repetition_penalty"] = penalty
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise ApiError(400, f"'stop' is a string or a list of up to 4 non-empty strings of at most "
                           f"{MAX_STOP_CHARS} characters", param="stop")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        return Request(prompt_ids, max_tokens, kwargs, stop, bool(body.get("stream")),
                       bool(options.get("include_usage")))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise ApiError(400, f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", param="prompt",
                               code="context_length_exceeded")
            ids = (await asyncio.to_thread(self.lm.tokenizer, prompt, add_special_tokens=True)).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
            vocab = self.lm.model.get_input_embeddings().num_embeddings
            if not all(0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids in 'prompt' must be in [0, {vocab})", param="prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
        if not ids:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return await self._answer(request, self._request(body, list(ids)), chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects with text content",
                           param="messages")
        if getattr(self.lm.tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise ApiError(400, f"the messages are longer than {MAX_PROMPT_CHARS} characters", param="messages",
                           code="context_length_exceeded")
        try:
            ids = await asyncio.to_thread(
                self.lm.tokenizer.apply_chat_template, [{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # the template's own rules (roles that must alternate, no system role): jinja raises
            raise ApiError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return await self._answer(request, self._request(body, list(ids)), chat=True)

    # --- answering ---------------------------------------------------------------------------------------------------

    async def _texts(self, req: Request, usage: Usage) -> AsyncIterator[tuple[str, str | None]]:
        """The completion as text pieces, then its finish reason ("stop": the end token or a stop string, not
        included; "length": max_tokens). Text that could still become a stop string is held back until it cannot."""
        ids = torch.tensor([req.prompt_ids])
        context = req.prompt_ids[-DECODE_CONTEXT:]
        decode = CompletionText(self.lm.tokenizer, context)
        new: list[int] = []
        sent = 0  # characters of the decoded completion already given out
        eos = set(self.lm.steps_eos())
        # Every token is the prompt's (a literal "<pad>" in a user's text is text): no padding to infer.
        steps = self.lm.steps(ids, torch.ones_like(ids), usage=usage, **self.speculative, **req.kwargs)
        async with contextlib.aclosing(steps):
            async for nxt in steps:
                token = int(nxt[0])
                if token in eos:
                    text = decode(new)
                    if len(text) > sent:  # what was held back (a possible stop string's start) was not one
                        yield text[sent:], None
                    yield "", "stop"
                    return
                new.append(token)
                text = decode(new)
                if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest of its bytes
                    continue
                for stop in req.stop:
                    at = text.find(stop)
                    if at >= 0:
                        if at > sent:
                            yield text[sent:at], None
                        yield "", "stop"
                        return
                safe = len(text) - max((_overlap(text, s) for s in req.stop), default=0)
                if safe > sent:
                    yield text[sent:safe], None
                    sent = safe
        text = decode(new)
        if len(text) > sent:
            yield text[sent:], None
        yield "", "length"

    async def _answer(self, request: web.Request, req: Request, chat: bool) -> web.StreamResponse:
        if self.running >= self.max_concurrent:
            raise ApiError(429, f"this gateway is generating {self.running} completions, its limit: try again shortly",
                           "rate_limit_error", code="too_many_requests")
        self.running += 1
        try:
            return await self._answer_now(request, req, chat)
        finally:
            self.running -= 1

    async def _answer_now(self, request: web.Request, req: Request, chat: bool) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = Usage()
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.model_name}
        if not req.stream:
            parts, finish = [], "length"
            try:
                texts = self._texts(req, usage)
                async with contextlib.aclosing(texts):  # a cancelled handler (the client hung up) closes its sessions
                    async for text, reason in texts:
                        parts.append(text)
                        finish = reason or finish
            except GpunetError as e:
                raise _api_error(e) from None
            text = "".join(parts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            return web.json_response({**base, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [choice], "usage": _usage(usage), **_gpunet(usage)})

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        started = False

        async def send(obj) -> None:
            nonlocal started
            if not started:
                await response.prepare(request)
                started = True
            await response.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        # As OpenAI: with stream_options.include_usage every chunk says "usage": null and a last chunk (no choices)
        # has it; without, the finishing chunk carries it (OpenAI's own omit it then: clients ignore the field).
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {} if delta_text is None else \
                    {"content": delta_text}
                return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                        **extra}
            return {**base, "choices": [{"index": 0, "text": delta_text or "", "logprobs": None,
                                         "finish_reason": finish}], **extra}

        try:
            texts = self._texts(req, usage)
            async with contextlib.aclosing(texts):
                first = await texts.__anext__()  # the first token (or the error) before the stream starts
                if chat:
                    await send(chunk(None, None, first=True))
                pending = [first]
                while pending:
                    text, finish = pending.pop()
                    if finish is not None:
                        last = chunk(None if chat else "", finish)
                        await send(last if req.include_usage else {**last, "usage": _usage(usage)})
                        break
                    if text:
                        await send(chunk(text, None))
                    pending.append(await texts.__anext__())
            if req.include_usage:
                await send({**base, "choices": [], "usage": _usage(usage)})
            await send(b"[DONE]")
        except GpunetError as e:
            if not started:
                raise _api_error(e) from None
            logger.warning("Request %s failed mid-stream: %s", rid, e)
            await send({"error": _api_error(e).body()["error"]})
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("Request %s: the client went away; its sessions are closed", rid)
            raise
        await response.write_eof()
        return response


class CompletionText:
    """The completion's text so far: the new tokens decoded after a few prompt tokens, less those tokens' own text,
    so a tokenizer that strips a leading space from a text's start (SentencePiece) does not strip the first word's."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer, self.context = tokenizer, list(context)
        self.prefix = tokenizer.decode(self.context, skip_special_tokens=True)

    def __call__(self, new: list[int]) -> str:
        text = self.tokenizer.decode(self.context + new, skip_special_tokens=True)
        if text.startswith(self.prefix):
            return text[len(self.prefix):]
        return self.tokenizer.decode(new, skip_special_tokens=True)  # the prefix itself changed: no better guess


def _overlap(text: str, stop: str) -> int:
    """How many characters at the end of ``text`` could begin ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


def _usage(usage: Usage) -> dict:
    prompt, completion = sum(usage.prompt_tokens), sum(usage.completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _gpunet(usage: Usage) -> dict:
    """What gpunet adds to a full answer: the cost and who served which span (other clients ignore it)."""
    out = {"cost_credits": usage.cost, "receipts": len(usage.receipts),
           "workers": sorted({w for row in usage.placement for _, _, w in row if w})}
    if usage.draft_proposed:  # speculative decoding (--draft): proposals made, and those the model kept
        out["draft_proposed"], out["draft_accepted"] = usage.draft_proposed, usage.draft_accepted
    return {"gpunet": out}


def _api_error(e: GpunetError) -> ApiError:
    if isinstance(e, NoWorkersAvailable):
        return ApiError(503, f"No workers can serve this model now: {e}", "server_error", code="no_workers")
    if isinstance(e, UsageError):
        return ApiError(400, str(e))
    return ApiError(502, f"The network failed to serve the request: {type(e).__name__}: {e}", "server_error",
                    code="network_error")


async def serve(gateway: Gateway, host: str, port: int, ready=None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (the CLI sets it on SIGINT/SIGTERM); ``ready(url)`` once it listens."""
    # A client that hangs up cancels its handler: a request it no longer waits for stops generating (and paying).
    runner = web.AppRunner(gateway.app, access_log=None, shutdown_timeout=5.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        if ready is not None:
            bound = runner.addresses[0] if runner.addresses else (host, port)
            ready(f"http://{bound[0]}:{bound[1]}/v1")
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


async def run_gateway(model: str, initial_peers, network: str, host: str, port: int, *, api_key: str | None = None,
                      max_length: int | None = None, spans: int | None = None, data_dir=None, name: str | None = None,
                      ready=None, workers_wait: float = 30.0, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                      draft: str | None = None, draft_tokens: int = 4) -> None:
    """``gpunet gateway``: a client of the network serving the checkpoint folder ``model`` until SIGINT/SIGTERM."""
    import signal
    from pathlib import Path

    from gpunet.client.api import AsyncClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncClient(initial_peers, network, data_dir) as client:
        deadline = time.monotonic() + workers_wait  # spans are cut to the memory of the workers seen
        while not await client.workers(refresh=True) and time.monotonic() < deadline and not stop.is_set():
            await asyncio.sleep(0.5)
        lm = await client.causal_lm(model, max_length=max_length, spans=spans)
        drafting = None
        if draft is not None:  # one model for every request (each keeps its own cache: speculative.Draft)
            from gpunet.client.llm.engine import load

            drafting = (await asyncio.to_thread(load, draft))[0]
        gateway = Gateway(lm._core, name or Path(model).resolve().name, api_key, max_concurrent, drafting,
                          draft_tokens)
        logger.info("Model %s: %d decoder layers in %d spans, max_length %d", gateway.model_name,
                    lm.spans[-1][1], len(lm.spans), lm.max_length)
        if not stop.is_set():
            await serve(gateway, host, port, ready, stop)
