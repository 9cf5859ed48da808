"""Small random-init causal LMs of every family gpunet serves, and a tokenizer trained here (nothing is downloaded):
for tests, ``gpunet demo --chat`` and ``scripts/bench_llm.py``."""

from __future__ import annotations

from pathlib import Path

import torch

#: A vocabulary of byte-level BPE: 256 bytes, a few merges and the special tokens.
VOCAB = 320
_D = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=256)

#: family -> (config class, model class, config arguments): the ten families of issue 39 and the MoE and variant ones.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=256)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _D),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_D, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _D),
    "phi": ("PhiConfig", "PhiForCausalLM", _D),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_D, head_dim=8)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      max_position_embeddings=256)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=256, word_embed_proj_dim=32)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                                         num_attention_heads=4)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_D, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_D, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_D, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_D, head_dim=8, sliding_window=8)),
}

#: Special tokens of the trained tokenizer (ids 0-2), and the chat template the gateway applies.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_TEXT = """The volunteers run workers on their home GPUs and the network routes jobs to them. A client submits a job
and pays for it with credits; each receipt is signed by both sides. Language models are cut into spans of layers,
each span kept on one worker with its cache, and tokens stream back to the user as they are generated. Hello world,
hello network, hello language model: the quick brown fox jumps over the lazy dog."""


def tiny_causal_lm(family: str, seed: int = 0, **overrides):
    """A random-init causal LM of ``family`` (eval mode), a few hundred KB."""
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**kwargs, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                                  **overrides})
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).eval()


def train_tokenizer():
    """A byte-level BPE tokenizer of ``VOCAB`` tokens, trained here on a paragraph, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_checkpoint(folder: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A checkpoint folder in HF layout (config.json, model.safetensors, tokenizer files) of a tiny random model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    model = tiny_causal_lm(family, seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer().save_pretrained(folder)
    return folder


def greedy_text(model, tokenizer, ids: list[int], new: int) -> str:
    """HF's greedy completion of ``ids`` as text, cut before the end token (as the gateway cuts it)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
    from gpunet.llm.gateway import DECODE_CONTEXT, CompletionText

    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    cut = next((i for i, t in enumerate(out) if t in eos), len(out))
    return CompletionText(tokenizer, ids[-DECODE_CONTEXT:])(out[:cut])


def stream_chat(url: str, body: dict, api_key: str | None = None, on_text=None) -> tuple[str, str | None, dict]:
    """A chat completion streamed from an OpenAI-compatible ``url`` (``.../v1``) read as raw server-sent events, no
    SDK: (the text, the finish reason, the usage of the last chunk); ``on_text(piece)`` as pieces arrive."""
    import http.client
    import json
    import urllib.parse

    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    conn.request("POST", u.path + "/chat/completions", json.dumps({**body, "stream": True}), headers)
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read().decode()[:500]}")
    text, finish, usage = [], None, {}
    try:
        while True:
            line = response.readline()
            if not line or line.strip() == b"data: [DONE]":
                break
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    text.append(piece)
                    if on_text is not None:
                        on_text(piece)
                finish = choice.get("finish_reason") or finish
    finally:
        conn.close()
    return "".join(text), finish, usage
