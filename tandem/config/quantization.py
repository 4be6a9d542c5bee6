"""The quantization section: the precision served by default, and with a fallback or per-class
precisions, the further variants of the model the engine holds (models/variants.py). YAML:
serving.quantization, {default, fallback, classes} or a precision alone (its default)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.option import option
from tandem.config.request_class import CLASS_NAMES

# A precision names one variant of the model. fp16 is the device's 16-bit float (bf16 on CPU,
# float16 on CUDA); int8 / int4 are weight-only, activations in the engine dtype.
PRECISIONS = ("bf16", "fp16", "fp32", "int8", "int4")


@dataclass(slots=True)
class QuantizationConfig:
    quantization: str | None = option(
        "auto",
        "the precision served: auto (as the weights are stored, e.g. int4 for a Q4 GGUF), "
        f"{', '.join(PRECISIONS)}",
        yaml="quantization.default",
    )
    precision_fallback: str | None = option(
        None,
        "the precision serving requests whose variant could not be built",
        none="none",
        yaml="quantization.fallback",
    )
    precision_classes: dict[str, str] | None = option(
        None,
        f"request class ({', '.join(CLASS_NAMES)}) -> precision, as JSON; each a variant held "
        "beside the default",
        none="none",
        yaml="quantization.classes",
    )

    def __post_init__(self) -> None:
        named = {"quantization": self.quantization, "fallback": self.precision_fallback}
        if self.precision_classes is not None and not isinstance(self.precision_classes, dict):
            raise ValueError("quantization classes must map a request class to a precision")
        for cls, variant in (self.precision_classes or {}).items():
            if cls not in CLASS_NAMES:
                raise ValueError(
                    f"quantization class {cls!r} is not a request class; "
                    f"known: {', '.join(CLASS_NAMES)}"
                )
            named[f"class {cls!r}"] = variant
        for what, precision in named.items():
            # auto: as stored
            known = ("auto", *PRECISIONS) if what == "quantization" else PRECISIONS
            if precision is not None and precision not in known:
                raise ValueError(
                    f"{what}: unknown precision {precision!r}; known: {', '.join(known)}"
                )

    def precisions(self, default: str) -> list[str]:
        """The variants to build, default first; `default` names what `quantization: auto`
        chose."""
        first = default if self.quantization in (None, "auto") else self.quantization
        names = [first, *(self.precision_classes or {}).values(), self.precision_fallback]
        return list(dict.fromkeys(n for n in names if n is not None))
