"""Tokenizers: a model directory's tokenizer.json (via `tokenizers`), else a built-in byte tokenizer.

Byte tokenizer ids: 0-255 are the bytes of the UTF-8 text, then BOS = 256, EOS = 257, PAD = 258.
"""

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


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        # Special and out-of-range ids (a random model can sample any id of its vocabulary) are dropped.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


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


def load_tokenizer(model_dir: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The directory's tokenizer.json when present, else the byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    return ByteTokenizer()
