"""``gpunet gateway``: a checkpoint folder served over a real swarm to the real ``openai`` client (issue 39)."""

import json
import http.client
import re
import urllib.parse
import urllib.request

import pytest
import torch

from gpunet.llm import load
from gpunet.testing.localnet import free_port
from gpunet.testing.llm import save_checkpoint
from tests.swarm import wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.swarm

MAX = 96


def sessions_open(port: int) -> float:
    """What a worker's Prometheus endpoint says of its open sessions."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^gpunet_sessions (\S+)$", text, re.M).group(1))


def greedy_text(reference, tok, ids: list[int], new: int) -> str:
    """HF's greedy completion of ``ids`` as text, cut at the end token as the gateway cuts it."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
    eos = reference.generation_config.eos_token_id
    if eos in out:
        out = out[:out.index(eos)]
    return tok.decode(out, skip_special_tokens=True)


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
    folder = save_checkpoint(tmp_path / "tiny-llama", "llama", seed=7)
    ports = [free_port() for _ in range(3)]
    workers = [swarm.start_worker("--metrics-port", str(p), wait_online=False) for p in ports]
    for w in workers:
        swarm.wait_online(w)
    gateway, url = swarm.start_gateway(folder, "--api-key", "sekrit", "--spans", "3", "--max-length", str(MAX))
    client = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0, timeout=120)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"

    assert [m.id for m in client.models.list()] == ["tiny-llama"]

    prompt = "hello network, the quick brown"
    done = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == greedy_text(reference, tok, tok(prompt).input_ids, 12)
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
