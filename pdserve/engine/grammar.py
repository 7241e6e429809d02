"""Grammars from specs (xgrammar): a tokenizer-free check for the ingress, and each worker's
compiler that compiles off the engine thread and caches by spec, so a repeat compiles nothing.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar_spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GrammarSpec

logger = logging.getLogger(__name__)

# Compiled grammars a worker keeps (least recently used go first): a typical schema's takes
# tens of kilobytes.
MAX_CACHED_GRAMMARS = 512
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f]")
# A UTF-16 surrogate's three bytes (ED A0..BF ..) are no UTF-8, yet xgrammar 0.2.8 accepts them
# inside a JSON string (measured): decoded they become U+FFFD and break maxLength and enums.
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec's grammar, independent of any tokenizer. JSON comes compact (no whitespace
    between tokens): free whitespace lets a model wander without ever closing the value.
    Raises InvalidRequestError saying why a schema cannot be turned into a grammar."""
    try:
        value = xgr.Grammar.from_json_schema(spec.source or '{"type": "object"}',
                                             any_whitespace=False, strict_mode=True)
        if spec.kind != "tool_call":
            return value
        return xgr.Grammar.concat(_literal(TOOL_CALL_OPEN), value, _literal(TOOL_CALL_CLOSE))
    except Exception as exc:  # noqa: BLE001 - client input: whatever the library says is a 400
        raise InvalidRequestError(f"the JSON schema cannot be used for constrained output: "
                                  f"{_first_line(exc)}") from exc


def check_grammar(spec: GrammarSpec) -> None:
    """Raises InvalidRequestError when the spec cannot become a grammar (what the ingress
    checks before any work is queued; workers then compile the same grammar)."""
    build_grammar(spec)


def _literal(text: str) -> xgr.Grammar:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return xgr.Grammar.from_ebnf(f'root ::= "{escaped}"')


def _first_line(exc: BaseException) -> str:
    """The library's reason, without its log prefix (time and source file of its C++)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__


def grammar_vocabulary(vocab_size: int, num_tokens: int, token_bytes: Callable[[int], bytes],
                       special_token_ids: frozenset[int]) -> list[bytes]:
    """Each of the model's ``vocab_size`` tokens as bytes, as the grammar sees them: control
    tokens as no bytes (the grammar library treats those as special, never as text), rows past
    the tokenizer's ``num_tokens`` (padding) as none.

    Tokens holding a control character other than a newline count as special too: JSON never
    holds one raw (RFC 8259) and the grammars here need none, yet xgrammar's string rule lets
    some through (``\x13`` inside a string, measured with 0.2.8)."""
    vocabulary = []
    for token_id in range(vocab_size):
        data = (b"" if token_id in special_token_ids or token_id >= num_tokens
                else token_bytes(token_id))
        vocabulary.append(b"" if _CONTROL.search(data) or _SURROGATE.search(data) else data)
    return vocabulary


@dataclass(frozen=True)
class SurrogateGuard:
    """What keeps a surrogate out when its bytes span two tokens: the tokens that end on an
    ED lead byte, and the bitmask words of the tokens that may follow one (not A0..BF)."""

    ends_on_lead: frozenset[int]
    after_lead: torch.Tensor  # int32 [ceil(vocab / 32)]

    @classmethod
    def of(cls, vocabulary: list[bytes]) -> SurrogateGuard:
        ends = frozenset(i for i, data in enumerate(vocabulary) if data.endswith(b"\xed"))
        allowed = torch.tensor([not (data and 0xA0 <= data[0] <= 0xBF) for data in vocabulary])
        return cls(ends, pack_bits(allowed))


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool vector as bitmask words (bit ``i % 32`` of word ``i // 32``), int32."""
    padded = torch.zeros(-(-len(allowed) // 32) * 32, dtype=torch.int64)
    padded[:len(allowed)] = allowed.to(torch.int64)
    words = (padded.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass
class GrammarStats:
    num_compiled: int = 0
    num_cache_hits: int = 0
    num_failed: int = 0  # grammars a worker could not compile after the ingress's check
    compile_s: float = 0.0  # total seconds spent compiling


class GrammarCompiler:
    """One worker's compiled grammars, by spec. `prefetch` starts a compile on the compiler's
    own thread and returns at once; `get` waits for it. Thread-safe."""

    def __init__(self, vocab_size: int, vocabulary: Callable[[], list[bytes]],
                 stop_token_ids: Sequence[int]) -> None:
        """``vocabulary``: called once, on the compiler's thread as it starts: every token's
        bytes (`grammar_vocabulary`)."""
        self.vocab_size = vocab_size
        self._vocabulary = vocabulary
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self.guard: SurrogateGuard | None = None  # set with the vocabulary
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self.stats = GrammarStats()
        # The vocabulary is read at once, on the compiler's thread: a large one takes a few
        # hundred milliseconds (measured: 230 ms at the medium preset's vocabulary), which the
        # first constrained request would otherwise wait for.
        self._pool.submit(self._ready)

    def prefetch(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
                self.stats.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The spec's compiled grammar (compiling it now if nobody asked before)."""
        return self.prefetch(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ready(self) -> xgr.GrammarCompiler:
        """The grammar library's compiler for this vocabulary (compiler thread only)."""
        if self._compiler is None:
            vocabulary = self._vocabulary()
            self.guard = SurrogateGuard.of(vocabulary)
            info = xgr.TokenizerInfo(vocabulary, xgr.VocabType.RAW,
                                     vocab_size=self.vocab_size,
                                     stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self._ready().compile_grammar(build_grammar(spec))
        except InvalidRequestError:
            with self._lock:  # a bad spec is not cached: the error says so each time
                self._compiled.pop(spec, None)
            raise
        seconds = time.perf_counter() - start
        self.stats.num_compiled += 1
        self.stats.compile_s += seconds
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind, seconds * 1000.0)
        return compiled
