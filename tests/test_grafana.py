"""docs/grafana/tandem.json is importable as it is (Grafana's dashboard model with a
Prometheus data-source input) and every expression names only metrics, and groups only by
labels, that a live P/D cluster's router exports on /metrics (instances' metrics included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from cluster_fixture import tiny_cluster, wait_for
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "tandem.json"
METRIC = re.compile(r"\b(tandem(?:_router)?:[A-Za-z0-9_:]+)")


def test_grafana_dashboard_is_importable():
    doc = json.loads(DASHBOARD.read_text())
    assert (
        doc["__inputs"][0]["name"] == "DS_PROMETHEUS"
        and doc["__inputs"][0]["pluginId"] == "prometheus"
    )
    assert doc["title"] and doc["uid"] and isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in doc["panels"]:
        assert (
            p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            and p["type"] == "timeseries"
            and p["targets"]
        )
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys()
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(
            t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]
        )


def test_every_expression_names_an_exported_metric(tiny_model_dirs):
    with tiny_cluster(tiny_model_dirs["llama"], roles=["prefill", "decode"]) as (url, _, _insts):
        for i in range(2):  # fill every histogram; prompts over 256 tokens go through a P/D handoff
            r = httpx.post(
                url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": list(range(1, 300)) + [i],
                    "max_tokens": 4,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
        # the handoff is counted when the prefill leg's last line (after the response) arrives
        assert wait_for(
            lambda: "tandem_router:kv_transfer_seconds_count" in httpx.get(url + "/metrics").text,
            10,
        )
        text = httpx.get(url + "/metrics", timeout=30).text
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    exprs = [t for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    for t in exprs:
        names = METRIC.findall(t["expr"])
        assert names, t["expr"]
        for name in names:
            assert name in labels, f"{name} (in {t['expr']!r}) is not on /metrics"
        have = set().union(*(labels[n] for n in names))
        grouped = {
            g.strip() for by in re.findall(r"by \(([^)]*)\)", t["expr"]) for g in by.split(",")
        } - {"le"}
        legend = set(re.findall(r"{{(\w+)}}", t["legendFormat"]))
        assert grouped | legend <= have, (
            f"{t['expr']!r} groups by labels the metrics lack: {(grouped | legend) - have}"
        )
