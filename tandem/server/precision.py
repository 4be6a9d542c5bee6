"""The server's side of precision choice: a `precision` field, a `model:precision` suffix, an
API key mapped to a request class; and the variants `/v1/models` lists."""

from __future__ import annotations

from tandem.config.request_class import CLASS_NAMES, priority_of
from tandem.engine.precision import PrecisionRouter


def split_model(model: str | None, served_names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(model name, precision suffix): `smollm2-135m:int4` -> ("smollm2-135m", "int4"). A name
    with a colon that is served as it is stays whole."""
    if model is None or model in served_names or ":" not in model:
        return model, None
    base, _, suffix = model.rpartition(":")
    return base, suffix


def request_precision(field: str | None, suffix: str | None, router: PrecisionRouter) -> str | None:
    """The request's own precision (the field wins over the suffix); ValueError if not served,
    by the router's one check, here so that the 400 names the `precision` field."""
    precision = field if field is not None else suffix
    router.check(precision)
    return precision


def key_priority(authorization: str | None, key_classes: dict[str, str] | None) -> int | None:
    """The priority level of the class an API key is mapped to (server config `api_key_classes`)."""
    if not key_classes or not authorization or not authorization.startswith("Bearer "):
        return None
    cls = key_classes.get(authorization.removeprefix("Bearer "))
    return None if cls is None else priority_of(cls)


def check_key_classes(key_classes: dict[str, str] | None) -> None:
    for cls in (key_classes or {}).values():
        if cls not in CLASS_NAMES:
            raise ValueError(
                f"api_key_classes: {cls!r} is not a request class ({', '.join(CLASS_NAMES)})"
            )


def model_cards(names: tuple[str, ...], router: PrecisionRouter, max_model_len: int) -> list[dict]:
    """Each served name (the first is the one responses report; the others are its aliases),
    then one `name:precision` entry per variant a request may name, of the first name."""
    name = names[0]
    card = {"object": "model", "created": 0, "owned_by": "tandem", "max_model_len": max_model_len}
    cards = [{"id": name, **card, "precision": router.default}]
    cards += [
        {"id": alias, **card, "root": name, "precision": router.default} for alias in names[1:]
    ]
    if len(router.served) > 1:
        cards += [
            {"id": f"{name}:{p}", **card, "root": name, "precision": p} for p in router.served
        ]
    return cards
