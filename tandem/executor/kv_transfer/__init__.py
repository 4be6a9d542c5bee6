"""KV transfer for prefill/decode disaggregation: payload, connectors, engine handoff."""
from tandem.executor.kv_transfer.base import KVConnector, LayerSink
from tandem.executor.kv_transfer.handoff import KVHandoff
from tandem.executor.kv_transfer.links import KVLinks
from tandem.executor.kv_transfer.payload import KVPayload, TransferStats
from tandem.executor.kv_transfer.shm import ShmConnector
from tandem.executor.kv_transfer.torch_dist import TorchDistConnector, init_kv_group

__all__ = ["KVConnector", "KVHandoff", "KVLinks", "KVPayload", "LayerSink", "ShmConnector",
           "TorchDistConnector", "TransferStats", "init_kv_group"]
