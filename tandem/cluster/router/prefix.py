"""The prompt's prefix hashes, as an instance's prefix cache computes them: the prompt is
tokenized exactly as the instance will (chat template, then encode) and its full blocks are
hashed with the same chained `hash_block`, so a hash the router computes is a hash the
instance reports when it holds that block."""

from __future__ import annotations

import logging
from typing import Any

from tandem.core.block_pool import hash_block, salt_hash
from tandem.server.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
MAX_BLOCKS = 1024  # hash at most this many leading blocks of a prompt


def prefix_hashes(
    token_ids: list[int], block_size: int, salt: str | None = None, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """`salt`: the precision variant's cache namespace (None: the default variant's), chained
    first as the instance's KV cache manager does, so a variant's blocks hash as it holds them."""
    out, parent = [], salt_hash(salt)
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


class PromptTokenizer:
    """One model's tokenizer in the router, as its instances load it (their `engine` options'
    tokenizer and chat template); without one, only token-id prompts are hashed."""

    def __init__(self, model: str | None, engine: dict[str, Any] | None = None) -> None:
        self.tokenizer = None
        if model is None:
            return
        engine = engine or {}
        try:
            from tandem.engine.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer(
                model, engine.get("tokenizer"), engine.get("chat_template")
            )
        except (OSError, ValueError) as e:  # routing still works, only without prefix affinity
            log.warning(
                "no tokenizer for %s (%s): prefix-aware routing only for token-id prompts", model, e
            )

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the instance will see them (first prompt of a batch), or
        None."""
        try:
            if path.endswith("/chat/completions"):
                if self.tokenizer is None:
                    return None
                # the instance's own chat prompt (engine/chat.py: tools, template kwargs and all)
                return self.tokenizer.encode(
                    ChatCompletionRequest.model_validate(body).chat_prompt(self.tokenizer)
                )
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, str) and self.tokenizer is not None:
                return self.tokenizer.encode(prompt)
        except (
            Exception
        ):  # bad input (schema, template): the instance answers with the error itself
            return None
        return None
