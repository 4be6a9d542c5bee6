"""Torch-free policy core: requests, KV block pool, scheduler. Shared by the engine and the
simulator."""
