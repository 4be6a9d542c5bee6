"""The speculative section: speculative decoding's method, draft and k (core/spec_planner.py
plans with it, executor/proposers/ drafts). Off when the engine has none."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.quantization import PRECISIONS

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, `tandem serve --speculative-config JSON`, or the YAML's
    `serving.speculative_decoding: {draft_model, verify_interval}` (from_yaml)."""

    method: str = "ngram"
    # The draft (method "draft"): self:int4 | self:int8 | self:bf16, an alias or a path.
    model: str | None = None
    num_speculative_tokens: int = 4  # k, drafts verified per step at most
    prompt_lookup_min: int = 1  # n-gram: shortest suffix matched
    prompt_lookup_max: int = 3  # n-gram: longest suffix matched (tried first)
    # k per step from batch size, acceptance and step costs (AdaptiveK); False: always k.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; known: {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative method 'draft' needs a model: self:int4, self:int8, self:bf16 "
                    "(the target's own variant) or another model's alias or path"
                )
            if (self.prompt_lookup_min, self.prompt_lookup_max) != (1, 3):
                raise ValueError(
                    "prompt_lookup_min / prompt_lookup_max are options of method 'ngram'; "
                    "method 'draft' takes none"
                )
        elif self.model is not None:
            raise ValueError(
                f"speculative model {self.model!r} given, but method {self.method!r} takes no model"
            )
        draft = self.self_draft
        if draft is not None and draft not in PRECISIONS:
            raise ValueError(
                f"speculative model self:{draft}: unknown precision {draft!r}; a self-draft "
                f"is one of self:{', self:'.join(PRECISIONS)}"
            )

    @property
    def self_draft(self) -> str | None:
        """The precision of a self-draft (`self:int4` -> "int4"), else None."""
        model = self.model or ""
        if self.method == "draft" and model.startswith("self:"):
            return model.removeprefix("self:")
        return None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler allocates past a sampling step's positions: a draft model writes
        its KV for the k positions it proposes in the same step (n-gram drafting writes none)."""
        return self.num_speculative_tokens if self.method == "draft" else 0

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        names = set(cls.__dataclass_fields__)
        unknown = set(values) - names
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(names))}"
            )
        return cls(**values)

    @classmethod
    def from_yaml(cls, section: dict | None) -> dict | None:
        """`serving.speculative_decoding` -> speculative_config keys: draft_model ngram is
        method ngram, another the draft of method draft; verify_interval is k; any other key
        is a speculative_config key by name. None: an empty section, off."""
        if not section:
            return None
        section = dict(section)
        out = {}
        if "draft_model" in section:
            draft = section.pop("draft_model")
            if draft not in (None, "ngram"):
                out["method"], out["model"] = "draft", draft
        if "verify_interval" in section:
            out["num_speculative_tokens"] = section.pop("verify_interval")
        out.update(section)  # any SpeculativeConfig key by name (method, ...)
        cls.from_dict(out)  # its errors now, naming the YAML's values
        return out
