"""The prompts the multi-host tests send and what one engine answers to them greedily."""

from __future__ import annotations

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

# Long enough to go to prefill (router.min_disaggregated_prompt_tokens is 16), of three sizes.
PROMPTS = [
    "Summarise the shipping rules for every region, then list the exceptions. " * n
    for n in (2, 5, 9)
]


def reference_texts(model_path: str, max_tokens: int, prompts: list[str] = PROMPTS) -> list[str]:
    """Each chat prompt's greedy answer from one engine in this process."""
    engine = LLMEngine(engine_config(model_path, num_kv_blocks=256))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts = []
    for prompt in prompts:
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}]))
        texts.append(engine.tokenizer.decode(engine.generate([ids], params)[0]))
    return texts
