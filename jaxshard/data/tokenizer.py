"""Tokenizers: UTF-8 bytes as tokens, or a Hugging Face ``tokenizers`` model -- a byte-level BPE
trained on the corpus (``--tokenizer bpe:N``) or any ``tokenizer.json`` (``--tokenizer PATH``).

Every tokenizer has an end-of-text id (``eot_id``) that the corpus puts between documents, so a
window that crosses from one file into the next shows the model where the first ended.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import tokenizers as hf

from jaxshard.errors import ConfigError, DataError

BYTES = "bytes"
BPE_EOT = "<|endoftext|>"
# end-of-text tokens of common tokenizer.json files (GPT-2, Llama 3 base, sentencepiece, Llama 3
# chat), in order of preference
EOT_TOKENS = (BPE_EOT, "<|end_of_text|>", "</s>", "<|eot_id|>")
MIN_BPE_VOCAB = 256 + 1  # the byte alphabet and the end-of-text token


@dataclass(frozen=True, slots=True)
class Spec:
    """A parsed ``--tokenizer``: ``bytes``, ``bpe:N`` (train N ids on the corpus) or a path."""

    kind: str  # 'bytes', 'bpe' or 'file'
    vocab_size: int | None = None  # bpe
    path: str | None = None  # file: a tokenizer.json or a folder holding one


def parse_spec(text: str) -> Spec:
    if text == BYTES:
        return Spec(BYTES)
    if text.startswith("bpe:"):
        n = text[4:]
        if not n.isdigit():
            raise ConfigError(f"--tokenizer bpe:N needs a whole number of ids N, got {text!r}")
        _check_bpe_vocab(int(n))
        return Spec("bpe", vocab_size=int(n))
    if text and (Path(text).is_file() or (Path(text) / "tokenizer.json").is_file()):
        return Spec("file", path=text)
    raise ConfigError(f"--tokenizer must be 'bytes', 'bpe:N' or a tokenizer.json (or a folder "
                      f"holding one), got {text!r}")


def _check_bpe_vocab(n: int) -> None:
    if n < MIN_BPE_VOCAB:
        raise ConfigError(f"a byte-level BPE needs a vocabulary of at least {MIN_BPE_VOCAB} "
                          f"(256 bytes and {BPE_EOT}), got {n}")


class Tokenizer:
    """Text to integer ids below ``vocab_size`` and back; ``eot_id`` separates documents
    (None: the tokenizer has none, and documents are joined directly)."""

    spec: str  # 'bytes', 'bpe:N' or the path it was loaded from
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def to_json(self) -> str | None:
        """The ``tokenizer.json`` content that rebuilds this tokenizer (``from_json``); None for bytes."""
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` to ``path`` (a file name, or an existing folder to put it in)."""
        text = self.to_json()
        if text is None:
            raise ConfigError(f"the {self.spec} tokenizer has no tokenizer.json to save")
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.write_text(text, encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text are its ids (uint8, vocab 256). The end-of-text id is 0, the
    NUL byte, which text corpora do not contain. Ids that are not UTF-8 (a window that cuts a
    character) decode to U+FFFD."""

    spec, vocab_size, eot_id = BYTES, 256, 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise DataError(f"byte ids must be in [0, 256), got {ids.min()}..{ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> None:
        return None


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` model; ids are int32. Encoding adds no special tokens (no
    BOS from a post-processor): the corpus places the end-of-text ids itself."""

    def __init__(self, tokenizer: hf.Tokenizer, spec: str):
        self.hf, self.spec = tokenizer, spec
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"tokenizer {spec} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1  # ids may be sparse (reserved added tokens)
        special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.eot_id = next((special[t] for t in EOT_TOKENS if t in special), None)

    @classmethod
    def from_json(cls, text: str, spec: str = "tokenizer.json") -> HFTokenizer:
        try:
            return cls(hf.Tokenizer.from_str(text), spec)
        except Exception as e:  # noqa: BLE001 -- the Rust side raises plain Exception
            raise DataError(f"not a valid tokenizer.json ({spec}): {_first_line(e)}") from None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes the texts in parallel (no character offsets computed)."""
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()


def train_bpe(documents: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme, no prefix space) with ``vocab_size`` ids at most, trained
    on ``documents`` on this machine. Id 0 is ``<|endoftext|>``, then the 256 byte symbols, then the
    merges; any UTF-8 text encodes and decodes back exactly."""
    _check_bpe_vocab(vocab_size)
    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOT], show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}")


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a ``tokenizer.json`` file, or of a folder holding one (a Hugging Face model
    folder). Its end-of-text id is the first of ``EOT_TOKENS`` among its special tokens."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read tokenizer {file}: {getattr(e, 'strerror', None) or e}") from None
    try:
        json.loads(text)
    except ValueError as e:
        raise DataError(f"tokenizer {file} is not JSON: {e}") from None
    return HFTokenizer.from_json(text, spec=str(path))


def tokenizer_from_spec(spec: Spec) -> Tokenizer:
    """The tokenizer a ``bytes`` or path spec names (``bpe:N`` is trained on a corpus instead)."""
    if spec.kind == BYTES:
        return ByteTokenizer()
    if spec.kind == "file":
        return load_tokenizer(spec.path)
    raise ConfigError(f"--tokenizer bpe:{spec.vocab_size} is trained on text data; it has no file to load")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
