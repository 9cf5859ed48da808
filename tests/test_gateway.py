"""``gpunet gateway``: a checkpoint folder served over a real swarm to the real ``openai`` client (issue 39)."""

import concurrent.futures
import json
import http.client
import re
import urllib.parse
import urllib.request

import pytest

from gpunet.llm import load
from gpunet.testing.localnet import free_port
from gpunet.testing.llm import greedy_text, save_checkpoint, stream_chat
from tests.swarm import wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.swarm

MAX = 96


def sessions_open(port: int) -> float:
    """What a worker's Prometheus endpoint says of its open sessions."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^gpunet_sessions (\S+)$", text, re.M).group(1))


def sse_events(url: str, body: dict, key: str) -> list[str]:
    """A raw server-sent-events read (no SDK): every ``data:`` payload, in order."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", u.path + "/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    raw = response.read().decode()
    conn.close()
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [b[len("data: "):] for b in blocks]


def test_a_checkpoint_served_to_the_openai_client_streams_what_hf_generates(swarm, tmp_path):
    """Served with a draft that nearly never agrees (another random model: speculative decoding's every step drops
    proposals from the spans' caches, a worker killed mid-stream makes its span replay them): the text is HF's own."""
    folder = save_checkpoint(tmp_path / "tiny-llama", "llama", seed=7)
    draft = save_checkpoint(tmp_path / "draft", "llama", seed=8)
    ports = [free_port() for _ in range(3)]
    workers = [swarm.start_worker("--metrics-port", str(p), wait_online=False) for p in ports]
    for w in workers:
        swarm.wait_online(w)
    gateway, url = swarm.start_gateway(folder, "--api-key", "sekrit", "--spans", "3", "--max-length", str(MAX),
                                       "--draft", str(draft), "--draft-tokens", "3")
    client = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0, timeout=120)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"

    assert [m.id for m in client.models.list()] == ["tiny-llama"]

    prompt = "hello network, the quick brown"
    done = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == greedy_text(reference, tok, tok(prompt).input_ids, 12)
    assert done.model_extra["gpunet"]["draft_proposed"] > done.model_extra["gpunet"]["draft_accepted"]  # (--draft)
    assert done.usage.prompt_tokens == len(tok(prompt).input_ids) and done.usage.completion_tokens >= 1

    messages = [{"role": "user", "content": "hello language model"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = greedy_text(reference, tok, list(chat_ids), 20)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(chat_ids)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])

    # The raw wire, as OpenAI sends it: data lines, a role chunk first, [DONE] last.
    events = sse_events(url, {"model": "tiny-llama", "messages": messages, "max_tokens": 20, "temperature": 0,
                              "stream": True}, "sekrit")
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" and p["model"] == "tiny-llama" for p in parsed)
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parsed) == want
    assert "usage" in parsed[-1] and parsed[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    # Concurrent requests each get their own sessions, and their own tokens.
    asks = ["hello", "the lazy dog", "volunteers run workers"]
    wants = [greedy_text(reference, tok, list(tok.apply_chat_template([{"role": "user", "content": a}],
                                                                     add_generation_prompt=True, tokenize=True,
                                                                     return_dict=False)), 16) for a in asks]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda a: stream_chat(url, {"model": "tiny-llama", "max_tokens": 16, "temperature": 0,
                                                            "messages": [{"role": "user", "content": a}]},
                                                      "sekrit")[0], asks))
    assert answers == wants

    # A stop string ends the text before it, as OpenAI's does.
    if len(want) > 6:
        stop = want[3:6]
        cut = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=20, temperature=0,
                                             stop=[stop])
        assert cut.choices[0].message.content == want[:want.index(stop)]
        assert cut.choices[0].finish_reason == "stop"

    # Errors in OpenAI's shape, with its status codes.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny-llama", prompt="hello " * 200, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, temperature=7)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()

    # A worker SIGKILLed mid-stream changes nothing in the stream: its span moves and replays.
    long_want = greedy_text(reference, tok, list(chat_ids), 60)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=60, temperature=0,
                                            stream=True)
    texts = []
    for i, c in enumerate(stream):
        texts.append(c.choices[0].delta.content or "" if c.choices else "")
        if i == 5:
            workers[1].kill()
    assert "".join(texts) == long_want and len(long_want) > 20

    # A client that goes away mid-stream ends its sessions: nothing stays reserved on the workers.
    alive = [p for w, p in zip(workers, ports) if w.popen.poll() is None]
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=60, temperature=0,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            assert sum(sessions_open(p) for p in alive) == 3  # the request's three spans, open
            break
    stream.close()
    wait_for(lambda: all(sessions_open(p) == 0 for p in alive), 30, "the workers to free the sessions")
    assert gateway.popen.poll() is None


def _post(url: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", u.path + path, body, headers)
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, json.loads(data)


def test_the_gateway_refuses_what_a_hostile_page_or_client_sends_in_openais_shape(swarm, tmp_path):
    """Without a key it answers only requests a web page cannot forge; bad input of every kind gets a 4xx in
    OpenAI's error shape and the gateway goes on serving; a user's literal "<pad>" is text, not padding."""
    folder = save_checkpoint(tmp_path / "tiny", "llama", seed=8)
    swarm.start_workers(1)
    gateway, url = swarm.start_gateway(folder, "--max-length", "64", "--max-concurrent", "1")
    ok = {"Content-Type": "application/json"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

    def error(status: int, path: str, body, headers=ok) -> dict:
        got, answer = _post(url, path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
        assert got == status, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        return answer["error"]

    error(415, "/chat/completions", json.dumps(chat).encode(), {"Content-Type": "text/plain"})  # a page's form
    error(403, "/chat/completions", chat, {**ok, "Host": "attacker.example"})  # DNS rebinding
    error(400, "/chat/completions", b"[" * 50000)
    error(400, "/chat/completions", b"{not json")
    error(400, "/chat/completions", {**chat, "max_tokens": "4"})
    error(400, "/chat/completions", {**chat, "max_tokens": True})
    error(400, "/chat/completions", {**chat, "seed": 2**70})
    error(400, "/chat/completions", {**chat, "messages": [{"role": "user", "content": ["x"]}]})
    error(400, "/chat/completions", {**chat, "stop": ["x" * 10000]})
    error(400, "/chat/completions", {**chat, "n": 3})
    error(400, "/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    error(400, "/completions", {"model": "tiny", "prompt": [10**30], "max_tokens": 2})
    assert error(400, "/completions", {"model": "tiny", "prompt": "x" * 70, "max_tokens": 2})["code"] == \
        "context_length_exceeded"

    status, answer = _post(url, "/completions", json.dumps(
        {"model": "tiny", "prompt": "hello <pad> world", "max_tokens": 3, "temperature": 1e-9}).encode(), ok)
    assert status == 200 and answer["usage"]["prompt_tokens"] == len(load(folder)[1]("hello <pad> world").input_ids)
    status, answer = _post(url, "/completions", json.dumps({"model": "tiny", "prompt": [5], "max_tokens": 2}).encode(),
                           ok)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 1

    # One completion at a time here: of two sent together, one is told to come back (429), the other is unharmed.
    def outcome(_):
        try:
            return stream_chat(url, {**chat, "max_tokens": 40})[1]
        except RuntimeError as e:
            return str(e)[:3]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = sorted(pool.map(outcome, range(2)))
    assert outcomes[0] == "429" and outcomes[1] in ("length", "stop"), outcomes
    assert gateway.popen.poll() is None
