"""The tokenizer a model is served with: its own, or `--tokenizer PATH` (a folder, a
tokenizer.json, or anything `--model` takes), with `--chat-template` (a Jinja file or the
template itself, as vLLM's) in place of the one it ships. The engine core (grammar
vocabulary, EOS), the front end (prompts, detokenising) and the router (prefix hashing) all
load it here, so each sees the same tokens and the same chat prompt."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.models.loader.model_files import load_config, load_tokenizer, resolve_model
from tandem.models.tokenizer_record import folder_files

JINJA_CHARS = "{}\n"  # a value holding any of these is a template, else a file path (vLLM's rule)


def read_chat_template(value: str) -> str:
    """The template text of `--chat-template`: the file it names, or the value itself; a
    template that Jinja (as transformers compiles chat templates) cannot parse is refused."""
    if any(c in value for c in JINJA_CHARS):
        template = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"--chat-template {value!r}: no such file (an inline template holds "
                "Jinja's {{ }} or {% %})"
            )
        template = path.read_text()
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(
            f"--chat-template {value if len(value) < 80 else value[:77] + '...'!r}: not a valid "
            f"Jinja template{where}: {e}"
        ) from None
    return template


def _load(source: str) -> Any:
    """The tokenizer at `source`: a folder with tokenizer files, a tokenizer.json, or a model
    (alias, .gguf, Hugging Face folder) whose tokenizer it is."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".json":
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        except Exception as e:  # the tokenizers library's own parse error
            raise ValueError(f"--tokenizer {source}: not a tokenizer.json ({e})") from None
    if path.is_dir() and not (path / "config.json").is_file():
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise FileNotFoundError(
                f"--tokenizer {source}: no tokenizer.json or tokenizer_config.json in it"
            )
        return tokenizer
    tokenizer = load_tokenizer(resolve_model(source))
    if tokenizer is None:
        raise FileNotFoundError(f"--tokenizer {source}: that model ships no tokenizer")
    return tokenizer


def get_tokenizer(
    model: str,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    model_dir: Path | None = None,
) -> Any:
    """The serving tokenizer of `model` (None when the model ships none and no other is given).
    ValueError, in words, for a tokenizer with more tokens than the model has embedding rows
    (its ids would index past them) or a chat template without any tokenizer to apply it."""
    template = read_chat_template(chat_template) if chat_template is not None else None
    model_dir = model_dir if model_dir is not None else resolve_model(model)
    if tokenizer is None:
        tok = _shared(Path(model_dir), lambda: load_tokenizer(model_dir))
    else:
        tok = _shared(Path(tokenizer).expanduser(), lambda: _load(tokenizer))
        rows = load_config(model_dir)["vocab_size"]
        if len(tok) > rows:
            raise ValueError(
                f"--tokenizer {tokenizer}: {len(tok)} tokens, but the model's embedding has "
                f"{rows} rows; its ids past {rows - 1} would have no embedding"
            )
    if template is not None:
        if tok is None:
            raise ValueError(
                f"--chat-template: {model} ships no tokenizer to apply it with; "
                "give --tokenizer too"
            )
        tok = copy.copy(tok)  # the shared one keeps its own template
        tok.chat_template = template
    return tok


_loaded: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()
_loaded_lock = threading.Lock()


def _shared(source: Path, load: Callable[[], Any]) -> Any:
    """One tokenizer per process for each source as it is on disk (its files' sizes and
    times), while anything holds it: an engine core, a front end and a router in one process,
    or several `LLM`s, share it instead of each parsing the tokenizer.json again (Gemma 3's
    33 MB: ~4 s); once none does, it is freed. Callers only read it; a chat template of their
    own goes on a copy."""
    try:
        key = (str(source.resolve()), tuple(map(tuple, folder_files(source))))
    except OSError:  # not a local path (an alias): resolve_model has said what it is
        key = (str(source),)
    with _loaded_lock:
        tok = _loaded.get(key)
    if tok is not None:
        return tok
    tok = load()
    if tok is None:  # the model ships none: nothing to share
        return None
    with _loaded_lock:
        return _loaded.setdefault(key, tok)
