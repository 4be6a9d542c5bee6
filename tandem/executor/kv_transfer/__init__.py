"""KV connectors, worker side: the bytes of the blocks their scheduler sides (core/kv_connector/)
hand out. The host tier's swap copies (host_tier.py); P/D's handoff (handoff.py), payload and
transports between instances."""

from tandem.executor.kv_transfer.base import KVTransport, LayerSink
from tandem.executor.kv_transfer.handoff import KVHandoff
from tandem.executor.kv_transfer.links import KVLinks
from tandem.executor.kv_transfer.payload import KVPayload, TransferStats
from tandem.executor.kv_transfer.shm import ShmTransport
from tandem.executor.kv_transfer.torch_dist import TorchDistTransport, init_kv_group

__all__ = [
    "KVHandoff",
    "KVLinks",
    "KVPayload",
    "KVTransport",
    "LayerSink",
    "ShmTransport",
    "TorchDistTransport",
    "TransferStats",
    "init_kv_group",
]
