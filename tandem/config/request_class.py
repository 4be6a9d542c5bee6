"""The request class: one concept under the names each side knows it by. A client names it as
`priority` (the class's name or its number), an API key maps to it (server `api_key_classes`),
the `quantization` section maps it to a precision variant (`classes`), and the multilevel
scheduler serves it as a level:

    class        priority  level  serves
    interactive  1         L1     short turns a person waits on: admitted the very next step,
                                  preempting L3 then L2 when seats or blocks are short
    standard     2         L2     everything else (the default; every request under fcfs): a
                                  guaranteed share of the token budget and seats
    background   3         L3     batch work, only on request: runs on what L1 and L2 leave
                                  idle, preempted first

A request's `priority` and its scheduler level are the same number (1-3); only the names differ.
"""

from __future__ import annotations

PRIORITIES = {
    "interactive": 1,
    "standard": 2,
    "background": 3,
}  # the table above: class -> priority
CLASS_NAMES = tuple(PRIORITIES)
LEVELS = tuple(PRIORITIES.values())  # the priorities, highest first
STANDARD = PRIORITIES["standard"]


def priority_of(value: str | int) -> int:
    """A request's priority from a class name or the number itself; ValueError otherwise."""
    if isinstance(value, str) and value in PRIORITIES:
        return PRIORITIES[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in LEVELS:
        return value
    raise ValueError(f"{value!r} is not a request class; known: {', '.join(CLASS_NAMES)} or 1-3")


def class_name(priority: int) -> str:
    """The class name of a priority (1-3); ValueError otherwise."""
    return CLASS_NAMES[priority_of(priority) - 1]
