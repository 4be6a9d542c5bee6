"""The simulated cluster's prefix-cache hit ratio set against the ideal on the same prompts,
for `tandem simulate`."""

from __future__ import annotations

from tandem.sim.cluster import ClusterSim
from tandem.sim.request import SimRequest
from tandem.workload.prefix_ideal import ideal_prefix_hits


def prefix_figures(sim: ClusterSim, reqs: list[SimRequest]) -> dict:
    """The cache's hit ratio over all instances against the ideal on the same prompts and block
    size: unbounded; bounded by the instances' KV blocks taken together (the best placement
    could do); and as placed (each instance's ideal cache on the prompts routed to it, so
    hit / as-placed is the cache's own efficiency, as-placed / bounded the routing's). Co-located
    only: under P/D a decode instance's lookups hit the KV it was sent, which is no reuse."""
    queries = sum(i.kv.stats.queries for i in sim.instances)
    hits = sum(i.kv.stats.hits for i in sim.instances)
    ordered = sorted(reqs, key=lambda r: r.arrival)
    prompts = [r.prompt_token_ids() for r in ordered]
    bs, blocks = sim.instances[0].kv.block_size, sum(i.kv.pool.num_blocks for i in sim.instances)
    ideal, bounded = ideal_prefix_hits(prompts, bs), ideal_prefix_hits(prompts, bs, blocks)
    placed = 0  # an ideal cache of each instance's size on the prompts routed to it
    for inst in sim.instances:
        mine = [
            p
            for r, p in zip(ordered, prompts)
            if r.instances and r.instances[0] == inst.instance_id
        ]
        placed += ideal_prefix_hits(mine, bs, inst.kv.pool.num_blocks)["hit_tokens"]
    ratio, tokens = (hits / queries if queries else 0.0), bounded["prompt_tokens"] or 1
    return {
        "hit_ratio": ratio,
        "ideal": ideal["token_ratio"],
        "ideal_cache_size": bounded["token_ratio"],
        "ideal_as_placed": placed / tokens,
        "share_of_ideal": ratio / bounded["token_ratio"] if bounded["token_ratio"] else None,
        "block_size": bs,
        "cache_blocks": blocks,
    }
