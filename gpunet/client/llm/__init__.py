"""A Hugging Face causal LM served by the swarm, on the client's side (docs/llm.md): ``adapter`` runs any family's own
decoder layers as gpunet blocks with a static KV cache, ``generation`` is HF's generation rules between steps,
``engine`` drives sessions (one per row), ``handles`` are what the user holds (``client.causal_lm``). Needs the
``llm`` extra (transformers).
"""

from gpunet.client.llm.adapter import UnsupportedModel
from gpunet.client.llm.engine import CausalLMCore, Usage, load
from gpunet.client.llm.handles import AsyncRemoteCausalLM, RemoteCausalLM

__all__ = ["AsyncRemoteCausalLM", "CausalLMCore", "RemoteCausalLM", "UnsupportedModel", "Usage", "load"]
