"""The one set of test helpers, imported as modules (``from tests.harness.service import ...``).

- ``waiting``: ``eventually`` (every wait in the suite is bounded).
- ``scrape``: reading a scrape (``parse_metrics``, ``samples``, ``metric_value``).
- ``wire``: the byte-exact wire vectors and loopback handshake addresses.
- ``service``: a config and the real exporter (``create_app``) over real HTTP with in-process
  simulated engines (``Service``, ``Services``; ``RecordingSimEngine`` records every request
  and every output frame through the simulated engine's public ``on_request`` and ``on_output``
  hooks).
- ``secure``: the service as ``serve`` starts it (TLS, basic auth) over simulated engines
  (``SecureFleets``), for clients of the secure listeners.
- ``restart``: exporters restarted over the same engines and state file (``RestartRig``).
- ``processes``: subprocesses (``SimProcess``, ``run_cli``, process-table helpers).
- ``rawengine`` / ``stockclient``: hand-driven engine and stock front end for conformance tests.
- ``owner``: an owner-mode ``EngineCoreClient`` over hand-driven engines (``OwnerHarness``).
- ``relay``: a simulated stock front end, relay exporters and simulated engines (``RelayHarness``).
- ``apiservers``: simulated vLLM API servers for the HTTP attach mode.
- ``artefacts``: paths and checks for the deployment artefacts (rules, dashboard, manifests).

Fixtures in ``conftest.py`` files only wire these helpers. Everything binds 127.0.0.1 on
kernel-chosen ports and every test builds its own exporter, so tests stay independent under
``pytest -n 2``.
"""
