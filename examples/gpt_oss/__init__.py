"""A GPT-OSS-shaped decoder served through the public tokenspeed-kernel APIs.

Modules: :mod:`.config` (dimensions), :mod:`.weights` (random seeded weights, MXFP4
experts), :mod:`.kvcache` (paged KV-cache manager and forward metadata), :mod:`.model`
(the decoder through the public APIs), :mod:`.torch_path` (the same decoder in plain
PyTorch, the comparison), :mod:`.serve` (prefill / chunked prefill / CUDA-graph decode).
See docs/e2e.md.
"""

from examples.gpt_oss.config import GptOssConfig
from examples.gpt_oss.kvcache import ForwardBatch, PagedKVCache
from examples.gpt_oss.model import GptOssModel, Overrides
from examples.gpt_oss.serve import OVERRIDE_PRESETS, DecodeRunner, Engine
from examples.gpt_oss.torch_path import TorchGptOss
from examples.gpt_oss.weights import ModelWeights, random_weights

__all__ = [
    "OVERRIDE_PRESETS",
    "DecodeRunner",
    "Engine",
    "ForwardBatch",
    "GptOssConfig",
    "GptOssModel",
    "ModelWeights",
    "Overrides",
    "PagedKVCache",
    "TorchGptOss",
    "random_weights",
]
