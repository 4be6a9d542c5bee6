"""Fakes of the engine surface the generate routes use, for testing a route module alone."""

from __future__ import annotations

from tandem.engine.output_processor import CompletionOutput, RequestMetrics, RequestOutput

EMPTY = "the prompt is empty"  # the engine's message (its input rules)


class FakeLLM:
    """The engine surface the generate routes use. It refuses an empty prompt as the engine does,
    and answers any other with one finished choice: the text "ok"."""

    alive, num_waiting = True, 0

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], object]] = []

    def generate(self, prompt_ids, params, request_id=None, priority=None, precision=None):
        self.requests.append((prompt_ids, params))

        async def stream():
            if not prompt_ids:
                raise ValueError(EMPTY)
            out = CompletionOutput(0, "ok", [6], "length", delta_text="ok", delta_token_ids=[6])
            yield RequestOutput(
                request_id,
                None,
                prompt_ids,
                [out],
                RequestMetrics(0.0, 0.1, 0.2, 0.2, 0.3),
                finished=True,
            )

        return stream()


class Writes(FakeLLM):
    """The engine surface, writing `text` a character at a time."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def generate(self, prompt_ids, params, request_id=None, priority=None, precision=None):
        self.requests.append((prompt_ids, params))

        async def stream():
            for i in range(1, len(self.text) + 1):
                done = i == len(self.text)
                out = CompletionOutput(
                    0,
                    self.text[:i],
                    list(range(i)),
                    "stop" if done else None,
                    delta_text=self.text[i - 1],
                    delta_token_ids=[i - 1],
                )
                metrics = RequestMetrics(0.0, 0.1, 0.2, 0.2, 0.3)
                yield RequestOutput(request_id, None, prompt_ids, [out], metrics, finished=done)

        return stream()
