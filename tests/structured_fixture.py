"""A tiny random Llama with a real (fast, byte-level BPE) tokenizer of its whole 512-token
vocabulary, all of it ASCII, and a plain chat template, so any token sequence decodes to clean
text: what structured-output tests need (the grammar engine matches bytes of tokens)."""

from __future__ import annotations

import random
import shutil
import string
from pathlib import Path

from tandem.models.loader.model_files import load_tokenizer

EOS = "<eos>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def with_tokenizer(model_dir: str, dst: Path, vocab_size: int = 512) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, dst)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    corpus = ['{"name": "Bob", "age": 42, "tags": ["a", "b"]}, yes no maybe true false null']
    corpus += [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 12))) for _ in range(20000)
    ]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dst)
    load_tokenizer(
        dst
    )  # AutoTokenizer picks the class once: servers started on dst load it directly
    return str(dst)
