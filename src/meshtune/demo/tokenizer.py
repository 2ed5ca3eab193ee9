"""A small byte-level BPE tokenizer trained locally, with Qwen's ChatML special tokens.

It stands in for a real model's tokenizer in the demo and the tests: nothing is downloaded, and it goes through
the same `AutoTokenizer.from_pretrained` path as a real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; pad = eos = <|endoftext|>, as in Qwen2."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
    )


def write_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train and save into `out_dir` (tokenizer.json + tokenizer_config.json), without a chat template."""
    tok = train_tokenizer(texts, vocab_size)
    tok.save_pretrained(str(out_dir))
    return tok
