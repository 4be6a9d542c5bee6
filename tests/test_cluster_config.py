"""cluster.yaml: the examples parse into the instances they promise; mistakes fail up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.config import load_cluster_config, parse_cluster_config
from tandem.cluster.launch.instances import plan
from tandem.cluster.launch.local_backend import instance_command
from tandem.cluster.router.prefix import prefix_hashes
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_examples():
    colocated = load_cluster_config(EXAMPLES / "cluster.yaml")
    specs = plan(colocated)
    assert [(s.group.kind, s.role) for s in specs] == [("chat", "colocated")] * 3 + [
        ("embedding", "colocated")
    ]
    assert len({s.id for s in specs}) == 4 and all(s.num_threads >= 1 for s in specs)
    pd = load_cluster_config(EXAMPLES / "cluster-pd.yaml")
    assert [s.role for s in plan(pd)] == ["prefill", "decode", "decode"]
    assert pd.kv_transfer.connector == "shm" and pd.router.migration.kv_usage == 0.9
    gloo = load_cluster_config(EXAMPLES / "cluster-pd-gloo.yaml")
    assert [s.role for s in plan(gloo)] == ["prefill", "decode", "decode"]
    assert (gloo.kv_transfer.connector, gloo.kv_transfer.backend) == ("torch_dist", "gloo")


def test_instance_command(tmp_path):
    cfg = parse_cluster_config(
        {
            "models": [
                {
                    "name": "m",
                    "model": "smollm2-135m",
                    "roles": {"elastic": 1},
                    "engine": {"block_size": 32},
                }
            ]
        }
    )
    spec = plan(cfg)[0]
    cmd = instance_command(spec, 9000, tmp_path / "m.yaml")
    assert cmd[cmd.index("--role") + 1] == "decode" and "--elastic" in cmd
    assert "block_size: 32" in (tmp_path / "m.yaml").read_text()


@pytest.mark.parametrize(
    "doc,error",
    [
        ({}, "models"),
        ({"models": [{"name": "a", "instances": 1, "roles": {"prefill": 1}}]}, "not both"),
        ({"models": [{"name": "a", "roles": {"prefil": 1}}]}, "unknown role"),
        ({"models": [{"name": "a", "kind": "vision"}]}, "chat or embedding"),
        ({"models": [{"name": "a", "engine": {"block_size": 3}}]}, "power of two"),
        ({"models": [{"name": "a", "engine": {"nope": 1}}]}, "unknown engine option"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"models": [{"name": "a"}], "backend": "k8s"}, "local or ray"),
        ({"models": [{"name": "a"}], "router": {"wieghts": {}}}, "unknown option"),
        (
            {"models": [{"name": "e", "kind": "embedding", "roles": {"decode": 1}}]},
            "no prefill/decode",
        ),
        ({"models": [{"name": "a"}], "kv_transfer": {"connector": "rdma"}}, "shm or torch_dist"),
        (
            {
                "models": [{"name": "a"}],
                "kv_transfer": {"connector": "torch_dist", "backend": "mpi"},
            },
            "gloo or nccl",
        ),
        ({"models": [{"name": "a"}], "kv_transfer": {"conector": "shm"}}, "unknown option"),
        (
            {"models": [{"name": "a"}], "router": {"migration": {"kv_usage": 0.7}}},
            "target_kv_usage < kv_usage",
        ),
        (
            {"models": [{"name": "a"}], "router": {"migration": {"cooldown_s": -1}}},
            "cooldown_s >= 0",
        ),
        (
            {"models": [{"name": "a"}], "router": {"migration": False}},
            "router.migration: a mapping",
        ),
        ({"models": [{"name": "a"}], "router": {"migration": {"kv_use": 0.9}}}, "unknown option"),
        ({"models": [{"name": "a", "restart": "maybe"}]}, r"models\[0\].restart: true or false"),
        (
            {
                "models": [{"name": "a", "restart": True}],
                "kv_transfer": {"connector": "torch_dist"},
            },
            "cannot rejoin",
        ),
        ({"models": [{"name": "a"}], "stop_timeout_s": 0}, "stop_timeout_s"),
    ],
)
def test_bad_configs(doc, error):
    with pytest.raises(ValueError, match=error):
        parse_cluster_config(doc)


def test_router_hashes_match_the_instance_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 15))
    req = Request("r", tokens, SamplingParams(max_tokens=1), 0.0, None)
    kv.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req)
    assert set(prefix_hashes(tokens, 4)) == set(kv.pool._cached)
