"""A tokenizer as a user brings one: byte-level BPE trained on the given documents, saved as tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

EOS = "<|end_of_text|>"


def train_tokenizer(docs: Sequence[str], path: Path, *, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainer=trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path
