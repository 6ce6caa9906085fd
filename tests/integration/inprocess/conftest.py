"""Fixtures of in-process mode's tests: simulated engines behind a simulated vLLM ``AsyncLLM``
(``tests.harness.inprocess``), for the fleet client, the trainer API and the plugin's routes.

* ``sim_vllm``: three engines (DP ranks 0-2) and their ``SimAsyncLLM``, stopped at the end;
* ``sim_vllm_factory``: ``await sim_vllm_factory(n, options, by_index=..., sleeping={1: True})``
  for any other fleet (every fleet it made is stopped at the end);
* ``embedded``: ``await embedded(llm, **settings)`` is ``start_exporter`` on loopback with
  kernel-chosen ports and fast polls; services not stopped by the test are stopped at the end
  (before the fleets: fixtures are torn down in reverse order of setup);
* ``env``: ``env(**settings)`` sets the plugin's environment (``tests.harness.plugin_app``);
* ``plugin_apps``: ``await plugin_apps(n, **fleet_options)`` is the plugin's app over ``n``
  simulated engines, ready (``ready=False``: not waited for, a hung engine's fleet never is);
  ``await plugin_apps.bare(engine_client)`` over any engine client. All stopped at the end.
* ``stat_logger``: the plugin's stat logger as vLLM builds it for a client of ranks 0-2,
  recording into the process's feed (detached again at the end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from exporter.client.inprocess.feed import FEED
from exporter.inprocess.statlogger import logger_class
from tests.harness.inprocess import EmbeddedExporters, SimVllm, SimVllmFactory
from tests.harness.plugin_app import PluginApps, plugin_env, vllm_series
from tests.unit.inprocess.test_statlogger import StandInBase


@pytest.fixture
async def sim_vllm_factory() -> AsyncIterator[SimVllmFactory]:
    factory = SimVllmFactory()
    yield factory
    await factory.close()


@pytest.fixture
async def sim_vllm(sim_vllm_factory: SimVllmFactory) -> SimVllm:
    return await sim_vllm_factory(3)


@pytest.fixture
async def embedded(sim_vllm_factory: SimVllmFactory) -> AsyncIterator[EmbeddedExporters]:
    # Depends on sim_vllm_factory so that the exporters stop before the fleets do.
    exporters = EmbeddedExporters()
    yield exporters
    await exporters.close()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``env(**settings)``: the plugin's environment (fast polls; see ``plugin_env``)."""
    plugin_env(monkeypatch)
    return lambda **settings: plugin_env(monkeypatch, **settings)


@pytest.fixture
def vllm_registry() -> Iterator[None]:
    """One series of "vLLM's own" in prometheus_client's global registry."""
    with vllm_series():
        yield


@pytest.fixture
async def plugin_apps(env: Callable[..., None], vllm_registry: None) -> AsyncIterator[PluginApps]:
    apps = PluginApps()
    yield apps
    await apps.close()


@pytest.fixture
def stat_logger() -> Iterator[Any]:
    """The plugin's stat logger as vLLM builds it for a client of ranks 0-2 (the process's
    feed), detached again after the test."""
    yield logger_class(StandInBase)(vllm_config=None, engine_indexes=[0, 1, 2])
    FEED.detach()
