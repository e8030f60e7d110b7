"""k3jax: JAX inference for Kimi-K3-class hybrid models (KDA + MLA + LatentMoE + AttnRes).

    import k3jax
    model = k3jax.load_model("k3-tiny")
    logits = model.logits(model.tokenizer.encode("Hello"))
"""

from k3jax.api import Model, load_model
from k3jax.config import ModelConfig, preset
from k3jax.engine.engine import LLM, Engine, EngineConfig, StreamDelta
from k3jax.engine.request import RequestOutput
from k3jax.sampling import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "Model", "ModelConfig", "RequestOutput", "SamplingParams",
           "StreamDelta", "load_model", "preset"]
__version__ = "0.1.0"
