"""KV connectors, scheduler side: a request's KV held outside its device blocks (base.py). The
host tier keeps swapped-out requests' blocks (host_tier.py); P/D reserves blocks for KV sent by
a prefill instance and pins them for the decode request (pd.py). Their worker sides, which move
the bytes, are in executor/kv_transfer/."""
