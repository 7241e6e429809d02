"""xgrammar against llguidance on a generated checkpoint's vocabulary: compile time of a
typical schema (first, cached) and the per-step mask cost (fill, apply) at batch 32.

llguidance is not a dependency: `pip install llguidance` to compare; without it only xgrammar
is measured. Each step draws every row's next token from random logits under its mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import DEFAULT_MODEL_DIR, ensure_checkpoint, offline, save_json, set_threads

from pdserve.engine.grammar import grammar_vocabulary
from pdserve.engine.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
        "required": ["street", "city"], "additionalProperties": False},
    "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "tags", "address", "role"], "additionalProperties": False}


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_steps(batch: int, vocab: int, steps: int, fill: Callable[[], torch.Tensor],
              apply: Callable[[torch.Tensor, torch.Tensor], None],
              accept: Callable[[list[int]], None]) -> dict[str, float]:
    """Median fill and apply seconds per step, every row sampling under its mask."""
    generator = torch.Generator().manual_seed(0)
    fills, applies = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator)
        start = time.perf_counter()
        bitmask = fill()
        fills.append(time.perf_counter() - start)
        applies.append(timed(lambda b=bitmask, lg=logits: apply(lg, b)))
        probs = torch.softmax(logits, dim=-1)
        accept(torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist())
    return {"fill_ms": ms(statistics.median(fills)), "apply_ms": ms(statistics.median(applies))}


def xgrammar_costs(vocabulary: list[bytes], eos: list[int], batch: int,
                   steps: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocabulary, xgr.VocabType.RAW, vocab_size=len(vocabulary),
                             stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    text = json.dumps(SCHEMA)
    out = {"compile_first_ms": ms(timed(lambda: compiler.compile_json_schema(text))),
           "compile_cached_ms": ms(timed(lambda: compiler.compile_json_schema(text)))}
    compiled = compiler.compile_json_schema(text, any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, len(vocabulary))

    def fill() -> torch.Tensor:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def accept(tokens: list[int]) -> None:
        for matcher, token in zip(matchers, tokens, strict=True):
            if matcher.is_terminated():
                matcher.reset()
            else:
                matcher.accept_token(token)

    return out | run_steps(batch, len(vocabulary), steps, fill,
                           lambda lg, b: xgr.apply_token_bitmask_inplace(lg, b), accept)


def llguidance_costs(vocabulary: list[bytes], tokenizer: Tokenizer, eos: list[int], batch: int,
                     steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.torch as llt

    class Vocabulary:
        eos_token_id, bos_token_id, tokens = eos[0], None, vocabulary
        special_token_ids = sorted(tokenizer.special_token_ids)

        def __call__(self, data: bytes) -> list[int]:
            return tokenizer.encode(data.decode("utf-8", "replace"))

    ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    out = {"compile_first_ms": ms(timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))),
           "compile_cached_ms": ms(timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar)))}
    matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor(num_threads=1)
    bitmask = llt.allocate_token_bitmask(batch, len(vocabulary))

    def fill() -> torch.Tensor:
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                        bitmask)
        return bitmask

    def accept(tokens: list[int]) -> None:
        for matcher, token in zip(matchers, tokens, strict=True):
            if matcher.is_stopped():
                matcher.reset()
            else:
                matcher.consume_token(token)

    return out | run_steps(batch, len(vocabulary), steps, fill,
                           lambda lg, b: llt.apply_token_bitmask_inplace(lg, b), accept)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="tiny", choices=("tiny", "medium", "small"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = p.parse_args()
    offline()
    print(set_threads(1))
    tokenizer = Tokenizer.from_checkpoint(ensure_checkpoint(args.model_dir, "llama", args.size))
    vocabulary = grammar_vocabulary(tokenizer.vocab_size, tokenizer.vocab_size,
                                    tokenizer.token_bytes, tokenizer.special_token_ids)
    eos = list(tokenizer.eos_token_ids)
    results = {"vocab_size": len(vocabulary), "batch": args.batch,
               "xgrammar": xgrammar_costs(vocabulary, eos, args.batch, args.steps)}
    try:
        results["llguidance"] = llguidance_costs(vocabulary, tokenizer, eos, args.batch,
                                                 args.steps)
    except ImportError:
        print("llguidance is not installed: measured xgrammar only")
    for engine in ("xgrammar", "llguidance"):
        if engine in results:
            print(f"{engine:10s} " + ", ".join(f"{k} {v:.3f}" for k, v in results[engine].items()))
    print(f"saved {save_json(f'grammar_engines_{args.size}', results)}")


if __name__ == "__main__":
    main()
