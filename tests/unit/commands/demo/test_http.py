"""The demo in HTTP mode: the engines are spread over at most three simulated API servers as
evenly as possible, each server plays its own slice of one fleet-wide story, the exporter is
pointed at every server, and the servers are stopped however serving (or starting) ends. The
servers and serving are replaced by recorders (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.commands.demo import http
from exporter.commands.demo.common import DemoOptions
from exporter.commands.demo.http import node_sizes, run_http_demo, start_nodes, stop_nodes
from exporter.config.settings import ServeConfig
from exporter.sim.options import ApiServerOptions


@pytest.mark.parametrize(
    ("engines", "sizes"),
    [(1, [1]), (2, [1, 1]), (3, [1, 1, 1]), (4, [2, 1, 1]), (8, [3, 3, 2]), (9, [3, 3, 3])],
)
def test_engines_per_node_as_even_as_possible(engines: int, sizes: list[int]) -> None:
    assert node_sizes(engines) == sizes
    assert sum(sizes) == engines


def test_the_node_cap_is_a_parameter() -> None:
    assert node_sizes(5, max_nodes=1) == [5]
    assert node_sizes(0) == [0]  # no engine: one empty node, never a division by zero


class FakeRunner:
    def __init__(self, name: str, log: list[str], fail_cleanup: bool = False) -> None:
        self.name, self.log, self.fail_cleanup = name, log, fail_cleanup

    async def cleanup(self) -> None:
        self.log.append(f"cleanup {self.name}")
        if self.fail_cleanup:
            raise RuntimeError("already stopped")


class Nodes:
    """``start_api_server`` recorded; ``fail_at``: the start that raises."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.options: list[ApiServerOptions] = []
        self.log: list[str] = []
        self.fail_at = fail_at
        monkeypatch.setattr(http, "start_api_server", self.start)

    async def start(
        self, host: str, port: int, options: ApiServerOptions
    ) -> tuple[FakeRunner, str]:
        assert (host, port) == ("127.0.0.1", 0)  # a free port each
        if len(self.options) == self.fail_at:
            raise OSError("cannot bind")
        self.options.append(options)
        i = len(self.options) - 1
        return FakeRunner(f"node{i}", self.log), f"http://127.0.0.1:{8000 + i}"


async def test_each_node_plays_its_slice_of_one_story(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = Nodes(monkeypatch)
    runners, targets = await start_nodes(5, 30.0)
    assert targets == ["node0=http://127.0.0.1:8000", "node1=http://127.0.0.1:8001",
                       "node2=http://127.0.0.1:8002"]  # fmt: skip
    assert [(o.engines, o.story_offset, o.story_count) for o in nodes.options] == [
        (2, 0, 5),
        (2, 2, 5),
        (1, 4, 5),
    ]
    assert {o.story_period_s for o in nodes.options} == {30.0} and len(runners) == 3
    assert {o.vllm_version for o in nodes.options} == {"0.33.0"}  # the simulation's default


async def test_a_node_that_cannot_start_stops_the_ones_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = Nodes(monkeypatch, fail_at=2)
    with pytest.raises(OSError, match="cannot bind"):
        await start_nodes(6, None)
    assert nodes.log == ["cleanup node0", "cleanup node1"]


async def test_stopping_goes_on_past_a_node_that_fails_to_stop() -> None:
    log: list[str] = []
    runners: list[Any] = [FakeRunner("a", log, fail_cleanup=True), FakeRunner("b", log)]
    await stop_nodes(runners)
    assert log == ["cleanup a", "cleanup b"]


@pytest.mark.usefixtures("no_exporter_env")
@pytest.mark.parametrize("failure", [None, OSError("address in use")])
async def test_the_exporter_is_pointed_at_every_node(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException | None
) -> None:
    nodes = Nodes(monkeypatch)
    served: list[tuple[ServeConfig, list[str], float]] = []

    async def serve(config: ServeConfig, headline: list[str], every: float, stop: Any) -> None:
        served.append((config, headline, every))
        if failure is not None:
            raise failure

    monkeypatch.setattr(http, "serve_demo", serve)
    options = DemoOptions(engines=2, attach="http", reset_every=3.0, vllm_version="0.34.0")
    if failure is None:
        assert await run_http_demo(options) == 0
    else:
        with pytest.raises(OSError):
            await run_http_demo(options)
    config, headline, every = served[0]
    assert config.attach == "http" and every == 3.0
    assert [o.vllm_version for o in nodes.options] == ["0.34.0", "0.34.0"]
    assert config.http_target == ("node0=http://127.0.0.1:8000", "node1=http://127.0.0.1:8001")
    assert headline == [
        "vllm-dp-exporter demo (attach http): 2 simulated engines behind 2 simulated vLLM "
        "API servers",
        "  API server      node0=http://127.0.0.1:8000",
        "  API server      node1=http://127.0.0.1:8001",
    ]
    assert nodes.log == ["cleanup node0", "cleanup node1"]
