"""What crosses between the API process and the engine-core process (msgpack, msgspec structs):
requests in, per-step output deltas and stats out. The in-process mode sends the same messages.

A utility (work the core does between two steps for the API side: P/D KV transfer, a grammar
compile, the stats) is a message type of its own, answered by the handler registered for that
type (`EngineCore.register_utilities`); its fields are the handler's keyword arguments. It
crosses inside a `UtilityCall` still encoded, so a malformed one is refused with its call's id."""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.core.outputs import EngineCoreOutput
from tandem.core.sampling_params import LoRARequest, SamplingParams, StructuredOutputsParams


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences in the core: itself, or `i_<id>` for n > 1."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class EngineCoreRequest(msgspec.Struct, tag="add"):
    """A request already tokenised and validated by the front end; one SamplingParams per
    sequence (n > 1: each with its own seed)."""

    request_id: str
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    arrival_time: float
    priority: int
    precision: str
    cache_salt: str | None = None
    kv_transfer: dict[str, Any] | None = (
        None  # opaque to the core: handed to the registered on_add hooks
    )


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # parent ids, or a sequence's id (a stop string ended it)
    stopped: bool = False  # finished by a stop string (FINISHED_STOPPED), not aborted


class CompileGrammar(msgspec.Struct, tag="compile_grammar"):
    """Compile a constraint (or find it cached) off the step loop; None, or the ValueError."""

    structured_outputs: StructuredOutputsParams


class AddLoRA(msgspec.Struct, tag="add_lora"):
    """Load a LoRA adapter between two steps; None, or the ValueError saying why it is refused."""

    lora: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    """Forget a LoRA adapter (a request still running with it reloads it)."""

    lora_int_id: int


class GetSchedulerStats(msgspec.Struct, tag="scheduler_stats"):
    """The engine's state and load report now (a SchedulerStats), outside a step."""


class JoinKVGroup(msgspec.Struct, tag="join_kv_group"):
    """Join the cluster's KV transfer group (the fields of POST /tandem/kv_group's body, which
    gives their defaults); this instance's rank once every rank joined."""

    rank: int
    world_size: int
    host: str
    port: int
    backend: str | None
    timeout_s: float


class CheckKVPeer(msgspec.Struct, tag="check_kv_peer"):
    """ValueError unless this instance has a KV link to `peer` (None: shared memory)."""

    peer: int | None


class SendKV(msgspec.Struct, tag="send_kv"):
    """Prefill side: export the prompt's whole blocks and start sending them; the block count."""

    token_ids: list[int]
    transfer_id: str
    peer: int | None


class MigrateOut(msgspec.Struct, tag="migrate_out"):
    """Abort a decoding request and send the KV of its tokens so far; the block count."""

    request_id: str
    token_ids: list[int]
    transfer_id: str
    peer: int | None


class KVSent(msgspec.Struct, tag="kv_sent"):
    """A send's outcome once the receiver has it: {kv_bytes, kv_seconds} or {error}."""

    transfer_id: str


class ReceiveKV(msgspec.Struct, tag="receive_kv"):
    """Decode side: reserve blocks for the prompt and receive into them: {kv_blocks, ...} or
    {error}."""

    token_ids: list[int]
    transfer_id: str
    peer: int | None


class ReleaseKV(msgspec.Struct, tag="release_kv"):
    """Give back the blocks held for a transfer whose decode request will not be added."""

    transfer_id: str


class DrainKV(msgspec.Struct, tag="drain_kv"):
    """Take a transfer off the link for a decode leg refused before it reserved."""

    transfer_id: str
    peer: int | None


UtilityMessage = (
    CompileGrammar
    | AddLoRA
    | RemoveLoRA
    | GetSchedulerStats
    | JoinKVGroup
    | CheckKVPeer
    | SendKV
    | MigrateOut
    | KVSent
    | ReceiveKV
    | ReleaseKV
    | DrainKV
)
UTILITY_MESSAGES: tuple[type, ...] = UtilityMessage.__args__
_utility_decoder = msgspec.msgpack.Decoder(UtilityMessage)


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    message: msgspec.Raw  # one UtilityMessage, msgpack: decoded by the core (decode_utility)


def utility_call(call_id: int, message: UtilityMessage) -> UtilityCall:
    """TypeError for anything but a utility message: nothing else has a handler in the core."""
    if not isinstance(message, UTILITY_MESSAGES):
        raise TypeError(f"not an engine-core utility message: {type(message).__name__}")
    return UtilityCall(call_id, msgspec.Raw(msgspec.msgpack.encode(message)))


def decode_utility(call: UtilityCall) -> UtilityMessage:
    """The call's message; ValueError naming what is wrong for an unknown or malformed one."""
    try:
        return _utility_decoder.decode(call.message)
    except (
        msgspec.DecodeError
    ) as e:  # ValidationError too: an unknown type, a missing or mistyped field
        raise ValueError(f"malformed engine-core utility message: {e}") from None


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


class SchedulerStats(msgspec.Struct):
    """The engine's state after a step (what /metrics and the dashboard read)."""

    num_running: int = 0
    num_waiting: int = 0
    running_by_level: dict[str, int] = {}
    waiting_by_level: dict[str, int] = {}
    kv_usage: float = 0.0
    kv_utilization: float = 0.0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    host_free_blocks: int = 0
    host_total_blocks: int = 0
    num_swapped: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    preemptions_by_mode: dict[str, int] = {}
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    instance: dict[str, Any] = {}  # the instance's load report (GET /tandem/state)
    grammar_compiles: list[tuple[str, float]] = []  # (kind, seconds) compiled since the last stats
    # LoRA adapter name -> its requests, tokens run, loads from its folder, evictions from a slot
    lora: dict[str, dict[str, int]] = {}


class ScheduledEvent(msgspec.Struct, array_like=True):
    """A sequence admitted (first time, or again after preemption)."""

    request_id: str
    time: float | None
    num_cached_tokens: int
    num_preemptions: int


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    """One step's deltas (or, with step_seconds None, a state change outside a step)."""

    outputs: list[EngineCoreOutput]
    timestamp: float  # time.monotonic() when the step's tokens were known
    scheduled: list[ScheduledEvent] = []
    step_seconds: float | None = None
    stats: SchedulerStats | None = None


class RequestErrors(msgspec.Struct, tag="errors"):
    """Requests the core ended on an error of its own (a failed step): their clients get it."""

    request_ids: list[str]
    message: str


class AddResult(msgspec.Struct, tag="added"):
    request_id: str
    error: tuple[str, str] | None = None  # (type name, message)


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: Any = None
    error: tuple[str, str] | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The handshake: the facts the API side needs, sent once the engine is built."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_kv_blocks: int
    default_precision: str
    unavailable_precisions: dict[str, str]
    weight_bytes: dict[str, int]
    pid: int
    stats: SchedulerStats  # the state before any request


class EngineDead(msgspec.Struct, tag="dead"):
    """The core loop failed for good (sent if it can be)."""

    message: str


EngineCoreEvent = EngineCoreOutputs | RequestErrors | AddResult | UtilityResult | Ready | EngineDead


def error_of(e: BaseException) -> tuple[str, str]:
    """An engine-core error as it crosses: (type name, message)."""
    return type(e).__name__, str(e)


def remote_error(type_name: str, message: str) -> Exception:
    """An engine-core error as the API side raises it: ValueError, TimeoutError and
    KVPoolFullError as themselves, anything else as RuntimeError."""
    if type_name == "ValueError":
        return ValueError(message)
    if type_name == "TimeoutError":
        return TimeoutError(message)
    if type_name == "KVPoolFullError":
        from tandem.core.kv_connector.pd import KVPoolFullError

        return KVPoolFullError(message)
    return RuntimeError(f"{type_name}: {message}")
