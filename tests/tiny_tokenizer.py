"""A tiny real HF tokenizer, built offline with the `tokenizers` library: byte-level BPE (so
'中文' splits into byte tokens that decode to U+FFFD until the character completes), saved by
transformers with a real chat template. Built once per process."""

from __future__ import annotations

import os
import shutil
import tempfile

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_DIR: list[str] = []


def tokenizer_dir() -> str:
    """Directory with tokenizer.json, tokenizer_config.json and the chat template."""
    if not _DIR:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        fast.chat_template = CHAT_TEMPLATE
        path = tempfile.mkdtemp(prefix="splash-tok-")
        fast.save_pretrained(path)
        _DIR.append(path)
    return _DIR[0]


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


def add_tokenizer(checkpoint_dir: str) -> str:
    """A copy of ``checkpoint_dir`` with the tiny tokenizer's files beside the weights."""
    out = tempfile.mkdtemp(prefix="splash-ckpt-tok-")
    shutil.copytree(checkpoint_dir, out, dirs_exist_ok=True)
    for name in os.listdir(tokenizer_dir()):
        shutil.copy(os.path.join(tokenizer_dir(), name), out)
    return out
