"""Tokenizers: a model directory's tokenizer.json (via `tokenizers`), else the built-in synthetic tokenizer
(UTF-8 bytes in, the model's whole vocabulary out as visible text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SyntheticTokenizer:
    """The tokenizer of random-weight presets (and of a model directory without tokenizer.json): every id of
    the model's vocabulary decodes to text, so a random model streams visible text like a real one.

    Ids 0-255 are the bytes of UTF-8 text (prompts encode to these; a lone or broken byte decodes to U+FFFD,
    C0 control bytes other than tab/newline/CR to their visible control pictures, U+2400 + byte). 256-258 are
    BOS, EOS and PAD: special, so they decode to nothing, as a served model's specials do. Ids 259 and up are
    output-only word pieces (" ba", " ko", ..., " bakodu"): a random model samples almost only these when its
    vocabulary is Qwen3's 151936.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    first_word_id = 259

    def __init__(self, vocab_size: int = 259) -> None:
        self.vocab_size = max(vocab_size, self.first_word_id)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        run = bytearray()  # consecutive byte ids decode together: a character may span several
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                parts.append(_visible(run.decode("utf-8", errors="replace")))
                run.clear()
            if self.first_word_id <= i < self.vocab_size:
                parts.append(word_piece(i - self.first_word_id))
        if run:
            parts.append(_visible(run.decode("utf-8", errors="replace")))
        return "".join(parts)


_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 80
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if chr(c) not in "\t\n\r"} | {0x7F: 0x2421}


def word_piece(n: int) -> str:
    """The n-th word piece: a space and syllables in bijective base 80, so every n has its own word."""
    syllables = []
    while True:
        syllables.append(_SYLLABLES[n % len(_SYLLABLES)])
        n = n // len(_SYLLABLES) - 1
        if n < 0:
            return " " + "".join(reversed(syllables))


def _visible(text: str) -> str:
    return text.translate(_CONTROL_PICTURES)


class HFTokenizer:
    """tokenizer.json of a Hugging Face directory; BOS/EOS from tokenizer_config.json or config.json."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        directory = Path(directory)
        self._tok = _Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._special_id(directory, "bos_token")
        self.eos_token_id = self._special_id(directory, "eos_token")

    def _special_id(self, directory: Path, name: str) -> int | None:
        path = directory / "tokenizer_config.json"
        if path.exists():
            token = json.loads(path.read_text()).get(name)
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token)
        config = directory / "config.json"
        if config.exists():
            value = json.loads(config.read_text()).get(f"{name}_id")
            if isinstance(value, list):
                value = value[0] if value else None
            return value
        return None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(
    model_dir: str | Path | None, *, vocab_size: int = 259
) -> SyntheticTokenizer | HFTokenizer:
    """The directory's tokenizer.json when present, else the synthetic tokenizer over `vocab_size` ids."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    return SyntheticTokenizer(vocab_size)
