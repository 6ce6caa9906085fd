"""``start_exporter`` with IPv6 listeners: its ``url`` and ``admin_url`` are URLs (the host in
brackets), usable as they are by ``exporter.remote``. Over real HTTP on ``::1``; skipped only
when the machine has no IPv6 loopback."""

from __future__ import annotations

import pytest

from exporter.base.ports import ipv6_loopback, url_host
from exporter.remote import Client
from tests.harness.inprocess import EmbeddedExporters, SimVllm
from tests.harness.plugin_app import WAIT_S

pytestmark = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")


async def test_an_ipv6_admin_url_drives_an_action_through_the_client(
    embedded: EmbeddedExporters, sim_vllm: SimVllm
) -> None:
    service = await embedded(sim_vllm.llm, listen="[::1]:0", admin_listen="[::1]:0")
    assert service.admin_url is not None
    assert service.admin_url.startswith("http://[::1]:"), service.admin_url
    assert service.url.startswith("http://[::1]:"), service.url
    async with Client(service.url, service.admin_url) as client:
        result = await client.reset_prefix_cache(timeout_s=WAIT_S)
        assert result.success and result.status == 200, result
        assert len(result.engines) == 3
        status = await client.status(timeout_s=WAIT_S)
        assert len(status.engines) == 3


def test_url_host_brackets_ipv6_only() -> None:
    assert url_host("::1") == "[::1]" and url_host("[::1]") == "[::1]"
    for host in ("127.0.0.1", "host"):
        assert url_host(host) == host
