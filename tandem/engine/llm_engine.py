"""The offline engine: the front end (input processor, output processor) and the engine core in
one process, driven by the caller's step() calls (LLM, the benches)."""

from __future__ import annotations

import dataclasses
import itertools

from tandem.config import EngineConfig
from tandem.core.request import RequestStatus
from tandem.core.sampling_params import LoRARequest, SamplingParams
from tandem.engine.core import EngineCore, ExecutorFactory, model_runner_factory
from tandem.engine.core_messages import EngineCoreOutputs, child_ids
from tandem.engine.engine_info import EngineInfo, StepCounters, engine_info, step_counters
from tandem.engine.input_processor import InputProcessor, PromptType
from tandem.engine.lora_names import startup_loras
from tandem.engine.output_processor import OutputProcessor, RequestOutput
from tandem.engine.precision import PrecisionRouter


class LLMEngine:
    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory = model_runner_factory
    ) -> None:
        self.config = config
        self.core = EngineCore(config, executor_factory)
        self.tokenizer = self.core.tokenizer
        self.max_model_len, self.vocab_size = self.core.max_model_len, self.core.vocab_size
        self.eos_token_id = self.core.eos_token_id
        variants = self.core.executor.variants
        self.precisions = PrecisionRouter(
            config.quant_config, variants.default, variants.unavailable
        )
        self.input_processor = InputProcessor(
            config.scheduler_config,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.precisions,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # adapter ids loaded: lora_modules' at start
        self._loras = {lora.lora_int_id for lora in startup_loras(config.lora_config)}

    def tokenize(self, prompt: PromptType) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int | None = None,
        precision: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input.
        `priority` 1/2/3 (interactive/standard/background); None: classified by length.
        `precision`: the variant asked for; None: the priority's class, else the default.
        `lora_request`: the adapter it runs with, loaded first (a refused one raises)."""
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
            params = dataclasses.replace(params, lora_request=lora_request)
        request_id = request_id if request_id is not None else str(next(self._ids))
        request = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, precision
        )
        self.core.add_request(request)
        self.output_processor.add(
            request_id,
            prompt if isinstance(prompt, str) else None,
            request.prompt_token_ids,
            list(zip(child_ids(request_id, params.n), request.params)),
            request.arrival_time,
            request.priority,
            request.precision,
        )
        return request_id

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter (once per id); ValueError: refused, nothing of it kept."""
        if lora.lora_int_id not in self._loras:
            self.core.add_lora(lora)
            self._loras.add(lora.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)
        self._loras.discard(lora_int_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort_requests([request_id])
        outs = self.output_processor.abort(self.output_processor.child_ids(request_id))
        return outs[0] if outs else None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One core step's outputs, detokenised (see EngineCore.step for which step)."""
        return self.process_outputs(self.core.step())

    def process_outputs(self, core_outputs: EngineCoreOutputs | None) -> list[RequestOutput]:
        if core_outputs is None:
            return []
        self.output_processor.on_scheduled(core_outputs.scheduled)
        outputs, stopped = self.output_processor.process(
            core_outputs.outputs, core_outputs.timestamp
        )
        if stopped:  # a stop string: the core still runs these sequences
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    # ---- read-only figures (the benches) ------------------------------------------
    def info(self) -> EngineInfo:
        """What the engine built: dtype, KV pool, precision variants and their weight bytes,
        graphs."""
        return engine_info(self.core)

    def step_counters(self) -> StepCounters:
        return step_counters(self.core)

    def trace_adaptive_k(self, callback) -> bool:
        """Hand AdaptiveK's choices and the steps it saw to `callback` (one dict each); False when
        the engine runs no adaptive policy."""
        return self.core.scheduler.planner.trace_policy(callback)

    def reset_stats(self) -> None:
        """Start the step figures afresh (see StepCounters), so a bench leaves out its warm-up."""
        self.core.stats.reset()

    def shutdown(self) -> None:
        """Stop the executor's worker thread: a process that builds engine after engine."""
        self.core.pipeline.shutdown()
