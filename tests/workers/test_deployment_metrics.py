"""docker-compose.yml's Prometheus reaches the workers: its scrape config names the worker services and the port
their environment gives SPEC_BATCH_METRICS_PORT."""

from __future__ import annotations

import yaml
from queue_testlib import REPO


def test_prometheus_scrapes_every_worker_service():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    prom = services["prometheus"]
    assert prom.get("profiles") == ["metrics"]  # optional, like flower
    mount = next(v for v in prom["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((REPO / mount.split(":")[0]).read_text())
    [job] = [j for j in config["scrape_configs"] if "dns_sd_configs" in j]
    [sd] = job["dns_sd_configs"]
    workers = {name for name, svc in services.items() if (svc.get("command") or [None, None])[1] == "worker"}
    assert workers and set(sd["names"]) == workers
    for name in workers:
        assert int(services[name]["environment"]["SPEC_BATCH_METRICS_PORT"]) == sd["port"]
        # /metrics binds to 127.0.0.1 by default: the compose network's Prometheus needs every interface
        assert services[name]["environment"]["SPEC_BATCH_METRICS_HOST"] == "0.0.0.0"
