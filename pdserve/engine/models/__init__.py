"""Model definitions: one `CausalLM` class serves the Llama and Qwen2 families.

Weights use Hugging Face tensor names; q/k/v and gate/up are fused at load time.
"""

from pdserve.engine.models.llama import CausalLM, LayerHook
from pdserve.engine.models.weights import WeightLoader, weight_targets

__all__ = ["CausalLM", "LayerHook", "WeightLoader", "weight_targets"]
