"""A model zoo as a new user would try it: Hugging Face transformers models (text, vision, audio), torchvision and timm
models at small random-init configs, and plain torch modules, each with example inputs. Nothing is downloaded. Used by
the coverage script (``scripts/model_coverage.py``) and the zoo test. Each library is optional: one that is missing
leaves its models out. transformers comes with the project's ``test`` extra; torchvision and timm live in
``.venv-zoo`` (``scripts/zoo_venv.sh``), because PyPI's torchvision is a CUDA build that, next to a CPU torch, needs
:func:`import_torchvision` and stops transformers from loading any model until that has run.

Each entry builds ``(module, args, kwargs)``; :func:`try_model` traces it into a job and compares the job's outputs
(run by the worker's own interpreter) with eager PyTorch's, saying at which step it failed if it did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Model:
    name: str
    kind: str  # text | vision | audio | torch
    build: Callable[[], tuple[torch.nn.Module, tuple, dict]]
    source: str = "torch"  # the library that defines it: torch | transformers | torchvision | timm


@dataclass
class ModelTrial:
    """How far one zoo model got on its way to a gpunet job whose outputs match eager PyTorch's (:func:`try_model`)."""

    name: str
    kind: str
    source: str
    ok: bool
    stage: str  # "ok", "build", "export", "run", "mismatch"
    detail: str = ""
    seconds: float = 0.0
    max_diff: float = 0.0


def _hf(name: str, kind: str, config: str, model: str, inputs: Callable[[], dict], **cfg) -> Model:
    def build():
        import transformers

        conf = getattr(transformers, config)(**cfg)
        module = getattr(transformers, model)(conf).eval()
        return module, (), inputs()

    return Model(name, kind, build, "transformers")


def _ids(n: int = 8, vocab: int = 100) -> Callable[[], dict]:
    def make():
        g = torch.Generator().manual_seed(0)
        return {"input_ids": torch.randint(0, vocab, (2, n), generator=g),
                "attention_mask": torch.ones(2, n, dtype=torch.long)}
    return make


def _image(size: int, channels: int = 3) -> torch.Tensor:
    return torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(0))


def _pixels(size: int = 32, channels: int = 3) -> Callable[[], dict]:
    return lambda: {"pixel_values": _image(size, channels)}


def _audio(n: int = 1600) -> Callable[[], dict]:
    return lambda: {"input_values": torch.randn(1, n, generator=torch.Generator().manual_seed(0))}


TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)
#: Decoder-only models return their KV cache object by default (a DynamicCache, which no job can carry): as a user
#: tracing a forward pass, turn it off (for generation, see client.sequential and gpunet.models' static cache).
DECODER = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, num_key_value_heads=2, use_cache=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=64)


def _plain() -> list[Model]:
    from torch import nn

    def mk(name, module_fn, *args):
        def build():
            torch.manual_seed(0)
            return module_fn().eval(), args, {}
        return Model(name, "torch", build)

    x = torch.randn(2, 16)
    img = torch.randn(1, 3, 16, 16)
    seq = torch.randn(2, 8, 32)
    return [
        mk("mlp", lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)), x),
        mk("cnn", lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                        nn.Conv2d(8, 8, 3, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Linear(8, 10)), img),
        mk("transformer-encoder", lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False), seq),
        mk("transformer-decoder-layer", lambda: _WithMemory(nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0,
                                                                                        batch_first=True)), seq),
        mk("multihead-attention", lambda: _SelfAttention(nn.MultiheadAttention(32, 4, batch_first=True)), seq),
        mk("groupnorm-unet-block", lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                                                         nn.ConvTranspose2d(8, 3, 2, stride=2)), img),
        mk("instance-norm", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4), nn.ReLU()), img),
        mk("weight-norm-conv1d", lambda: nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 3)),
           torch.randn(1, 8, 20)),
        mk("embedding-bag", lambda: _Bag(), torch.randint(0, 50, (4, 6))),
        mk("gpunet-tiny-gpt-block", lambda: _TinyBlock(), torch.randn(1, 4, 64)),
    ]


class _WithMemory(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, x)


class _SelfAttention(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 16, mode="mean")

    def forward(self, ids):
        return self.bag(ids)


class _TinyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from gpunet.models import Block, TinyConfig

        self.block = Block(TinyConfig(max_len=16))
        self.state = self.block.initial_state()

    def forward(self, x):
        return self.block(x, *self.state)[0]


def models() -> list[Model]:
    """Every model of the zoo this environment can build (a library's only where it is installed)."""
    return _plain() + _transformers() + _torchvision() + _timm()


def _transformers() -> list[Model]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    return [
        _hf("bert", "text", "BertConfig", "BertModel", _ids(), **TEXT),
        _hf("roberta", "text", "RobertaConfig", "RobertaModel", _ids(), **TEXT, pad_token_id=1),
        _hf("distilbert", "text", "DistilBertConfig", "DistilBertModel", _ids(), vocab_size=100, dim=32, n_layers=2,
            n_heads=2, hidden_dim=64, max_position_embeddings=64),
        _hf("albert", "text", "AlbertConfig", "AlbertModel", _ids(), **TEXT, embedding_size=16),
        _hf("electra", "text", "ElectraConfig", "ElectraModel", _ids(), **TEXT, embedding_size=16),
        _hf("gpt2", "text", "GPT2Config", "GPT2Model", _ids(), vocab_size=100, n_embd=32, n_layer=2, n_head=2,
            n_positions=64, use_cache=False, bos_token_id=1, eos_token_id=2),
        _hf("opt", "text", "OPTConfig", "OPTModel", _ids(), vocab_size=100, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2),
        _hf("llama", "text", "LlamaConfig", "LlamaModel", _ids(), **DECODER),
        _hf("mistral", "text", "MistralConfig", "MistralModel", _ids(), **DECODER),
        _hf("qwen2", "text", "Qwen2Config", "Qwen2Model", _ids(), **DECODER),
        _hf("gemma", "text", "GemmaConfig", "GemmaModel", _ids(), **DECODER, head_dim=16),
        _hf("phi", "text", "PhiConfig", "PhiModel", _ids(), **DECODER),
        _hf("t5-encoder", "text", "T5Config", "T5EncoderModel", _ids(), vocab_size=100, d_model=32, d_kv=16,
            d_ff=64, num_layers=2, num_heads=2),
        _hf("mpnet", "text", "MPNetConfig", "MPNetModel", _ids(), **TEXT),
        _hf("vit", "vision", "ViTConfig", "ViTModel", _pixels(), **VIT),
        _hf("deit", "vision", "DeiTConfig", "DeiTModel", _pixels(), **VIT),
        _hf("beit", "vision", "BeitConfig", "BeitModel", _pixels(), **VIT, vocab_size=100),
        _hf("dinov2", "vision", "Dinov2Config", "Dinov2Model", _pixels(), **VIT),
        _hf("convnext", "vision", "ConvNextConfig", "ConvNextModel", _pixels(), num_channels=3,
            hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
        _hf("swin", "vision", "SwinConfig", "SwinModel", _pixels(), image_size=32, patch_size=4, embed_dim=16,
            depths=[1, 1], num_heads=[2, 2], window_size=4),
        _hf("resnet", "vision", "ResNetConfig", "ResNetModel", _pixels(), embedding_size=8,
            hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
        _hf("regnet", "vision", "RegNetConfig", "RegNetModel", _pixels(), embedding_size=8,
            hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], groups_width=8),
        _hf("mobilenet-v2", "vision", "MobileNetV2Config", "MobileNetV2Model", _pixels(), depth_multiplier=0.25),
        _hf("segformer", "vision", "SegformerConfig", "SegformerModel", _pixels(), hidden_sizes=[8, 16, 32, 64],
            num_attention_heads=[1, 1, 2, 2], depths=[1, 1, 1, 1], decoder_hidden_size=32),
        _hf("wav2vec2", "audio", "Wav2Vec2Config", "Wav2Vec2Model", _audio(), **TEXT, conv_dim=(16, 16),
            conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2),
        _hf("hubert", "audio", "HubertConfig", "HubertModel", _audio(), **TEXT, conv_dim=(16, 16),
            conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2),
        Model("whisper-encoder", "audio", _whisper_encoder, "transformers"),
    ]


#: The schemas of the torchvision ops its import registers fakes for unconditionally (see import_torchvision).
_TORCHVISION_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_torchvision_ops: list = []  # the torch.library.Library declaring them: dropping it would undeclare them


def import_torchvision():
    """``import torchvision``, also where its C++ ops cannot load.

    PyPI's torchvision wheels are CUDA builds: their ops library (nms, roi_align, deform_conv2d) links libtorch_cuda,
    so next to a CPU torch it does not load, and the import then fails registering a fake for an op that was never
    declared ("operator torchvision::nms does not exist"). The models are plain Python and use none of those ops:
    declaring the two schemas the import needs lets it finish, with the C++ ops still absent (``torchvision.ops.nms``
    raises "no kernel", as it should). Where the ops load (a CUDA torch, or a CPU torchvision build), nothing is
    declared.
    """
    import sys

    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    if not _torchvision_ops:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _TORCHVISION_SCHEMAS:
            lib.define(schema)
        _torchvision_ops.append(lib)
    import torchvision
    return torchvision


def _torchvision() -> list[Model]:
    try:
        tv = import_torchvision()
    except ImportError:
        return []
    m = tv.models

    def mk(name, make, size, *, channels_last=False):
        def build():
            torch.manual_seed(0)
            module, x = make().eval(), _image(size)
            if channels_last:  # the layout whose adaptive pooling torch decomposes into as_strided (ConvNeXt, Swin)
                module, x = module.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
            return module, (x,), {}
        return Model(f"tv-{name}", "vision", build, "torchvision")

    return [
        mk("resnet18", lambda: m.resnet18(), 64),
        mk("mobilenet-v3-small", lambda: m.mobilenet_v3_small(), 64),
        mk("efficientnet-b0", lambda: m.efficientnet_b0(), 64),
        mk("convnext-tiny-channels-last", lambda: m.convnext_tiny(), 64, channels_last=True),
        mk("swin-t", lambda: m.swin_t(), 64),
        mk("vit", lambda: m.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                              mlp_dim=64), 32),
        mk("maxvit", lambda: m.MaxVit(input_size=(64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32],
                                      block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0), 64),
        mk("regnet-y-400mf", lambda: m.regnet_y_400mf(), 64),
        mk("shufflenet-v2", lambda: m.shufflenet_v2_x0_5(), 64),
        mk("squeezenet", lambda: m.squeezenet1_0(), 64),
        mk("googlenet", lambda: m.googlenet(aux_logits=False, init_weights=False), 64),
        mk("inception-v3", lambda: m.inception_v3(aux_logits=False, init_weights=False), 96),
    ]


def _timm() -> list[Model]:
    try:
        import_torchvision()
        import timm
    except ImportError:
        return []

    def mk(name, size, **kw):
        def build():
            torch.manual_seed(0)
            module = timm.create_model(name, pretrained=False, **kw).eval()
            return module, (_image(size),), {}
        return Model(f"timm-{name}", "vision", build, "timm")

    return [
        mk("vit_tiny_patch16_224", 32, img_size=32, patch_size=8),
        mk("eva02_tiny_patch14_224", 56, img_size=56),
        mk("levit_128s", 64, img_size=64),
        mk("mixer_s16_224", 64, img_size=64),
        mk("poolformer_s12", 64),
        mk("mobilevit_xxs", 64),
        mk("edgenext_xx_small", 64),
        mk("fastvit_t8", 64),
        mk("coatnet_nano_rw_224", 64, img_size=64),
        mk("efficientvit_b0", 64),
        mk("xcit_nano_12_p16_224", 64, img_size=64),
        mk("ghostnet_100", 64),
        mk("convnext_atto", 64),
        mk("mambaout_femto", 64),
        mk("nfnet_l0", 64),
    ]


def _whisper_encoder():
    import transformers

    conf = transformers.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, encoder_attention_heads=2,
                                      decoder_layers=1, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                      suppress_tokens=[], begin_suppress_tokens=[])
    encoder = transformers.WhisperModel(conf).eval().get_encoder()
    return encoder, (), {"input_features": torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))}


def _leaves(x: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def try_model(model: Model, atol: float = 1e-4) -> ModelTrial:
    """Trace ``model`` into a job, run it through the worker's interpreter, compare with eager."""
    from gpunet import GpunetError, Job

    t0 = time.perf_counter()

    def out(ok: bool, stage: str, detail: str = "", diff: float = 0.0) -> ModelTrial:
        return ModelTrial(model.name, model.kind, model.source, ok, stage, detail[:300], time.perf_counter() - t0, diff)

    try:
        module, args, kwargs = model.build()
    except Exception as e:  # a config this transformers version does not take: the zoo's problem, not gpunet's
        return out(False, "build", f"{type(e).__name__}: {e}")
    try:
        job = Job.from_module(module, args, example_kwargs=kwargs or None)
    except GpunetError as e:
        return out(False, "export", str(e))
    try:
        got = job.run_locally(*args, **kwargs)
    except GpunetError as e:
        return out(False, "run", str(e))
    with torch.inference_mode():
        want = module(*args, **kwargs)
    a, b = _leaves(got), _leaves(want)
    if len(a) != len(b):
        return out(False, "mismatch", f"{len(a)} outputs, eager gives {len(b)}")
    diff = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return out(False, "mismatch", f"{x.dtype} {list(x.shape)} vs eager {y.dtype} {list(y.shape)}")
        if x.numel():
            diff = max(diff, (x.double() - y.double()).abs().max().item())
    if not diff <= atol:
        return out(False, "mismatch", f"max difference {diff:.3g}", diff)
    if type(got) is not type(want) and not isinstance(want, torch.Tensor):
        return out(False, "mismatch", f"returned a {type(got).__name__}, eager a {type(want).__name__}", diff)
    return out(True, "ok", "", diff)
