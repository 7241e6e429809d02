"""Trains the byte-level BPE tokenizer that generated checkpoints ship (offline, deterministic).

Text: the shipped multilingual corpus plus pseudo-words drawn from a fixed-seed generator.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)  # ids 0, 1, 2

# ChatML, as Qwen2-style instruct models use it, with Qwen2.5's tools section: the tools as JSON
# lines in the system turn, calls as <tool_call> JSON in the assistant's turn, results as
# <tool_response> in a user turn. Without tools the text is plain ChatML.
_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n"
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + _TOOLS_INTRO + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + _TOOLS_OUTRO + "' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The corpus text is fixed; only its length (in pseudo-words) grows with the target vocabulary.
_TEXT_SEED = 1234
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_FOREIGN = ("é", "ü", "ñ", "ø", "ç", "ł", "ж", "ю", "λ", "ß", "水", "火", "山", "月", "の", "한")


def corpus_text() -> str:
    """The multilingual text shipped with the package."""
    return (
        resources.files("pdserve.engine")
        .joinpath("corpus/mixed_text.txt")
        .read_text(encoding="utf-8")
    )


def _pick(rng: random.Random, options: str | tuple[str, ...]) -> str:
    # Only rng.random(): its sequence is stable across Python versions, unlike randrange/choice.
    return options[int(rng.random() * len(options))]


def _pseudo_word(rng: random.Random) -> str:
    num_syllables = 1 + int(rng.random() * 4)
    syllables = []
    for _ in range(num_syllables):
        syllable = _pick(rng, _CONSONANTS) + _pick(rng, _VOWELS)
        if rng.random() < 0.3:
            syllable += _pick(rng, _CONSONANTS)
        if rng.random() < 0.05:
            syllable += _pick(rng, _FOREIGN)
        syllables.append(syllable)
    return "".join(syllables)


def pseudo_text_lines(num_words: int, lexicon_size: int) -> Iterator[str]:
    """Deterministic sentences over a Zipf-distributed lexicon of pseudo-words."""
    rng = random.Random(_TEXT_SEED)
    lexicon = [_pseudo_word(rng) for _ in range(lexicon_size)]
    words: list[str] = []
    for _ in range(num_words):
        # Inverse-CDF-ish draw that favours low ranks, like natural word frequencies.
        rank = int(lexicon_size ** rng.random()) - 1
        word = lexicon[rank]
        if not words:
            word = word.capitalize()
        words.append(word)
        if rng.random() < 0.08:
            yield " ".join(words) + _pick(rng, (".", ".", ".", "?", "!", ";"))
            words = []
    if words:
        yield " ".join(words) + "."


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with the ChatML special tokens, about `vocab_size` entries."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Roughly 4 pseudo-words per merge keeps enough distinct pairs to reach the target size.
    num_words = max(4000, 4 * vocab_size)
    lines = corpus_text().splitlines() + list(pseudo_text_lines(num_words, lexicon_size=vocab_size))
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> int:
    """Write tokenizer.json + tokenizer_config.json into `out_dir`; return the real vocab size."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
    return tokenizer.get_vocab_size()
