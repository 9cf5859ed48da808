"""Language models as people serve them (docs/llm.md): ``client.causal_lm(model_or_folder)`` (the engine lives on the
client's side, :mod:`gpunet.client.llm`) and ``gpunet gateway``, an OpenAI-compatible HTTP server over it
(:mod:`gpunet.llm.gateway`). Needs the ``llm`` extra (transformers).
"""

from gpunet.client.llm import AsyncRemoteCausalLM, RemoteCausalLM, UnsupportedModel, Usage, load

__all__ = ["AsyncRemoteCausalLM", "RemoteCausalLM", "UnsupportedModel", "Usage", "load"]
