"""Each engine's KV-events publisher, from the ``kv_events_config`` of its registration: where a
KV-index consumer (a router's prefix-cache index) connects to that DP rank's events.

vLLM's stock front end keeps this per rank in its engine-core client and nowhere a consumer can
reach without the API server (docs/protocol.md B.6.1); the exporter receives the same
registration in owner and relay mode, so it can say, per rank, what to connect to.

What an engine sends (vLLM 0.32 and 0.33, ``EngineCoreProc._make_ready_response``): its
publisher's *resolved* ``KVEventsConfig`` as an 8-key map, or nil when it publishes nothing
(events off, or publisher ``"null"``). Resolved means ``ZmqEventPublisher`` has already added the
DP index to the TCP port (``offset_endpoint_port``, reproduced here for simulators) and, for
``tcp://*:0``, bound the node's IP and an OS-chosen port: the endpoint in a registration is that
rank's own, never offset again here. A wildcard host (``tcp://*:5557``) is the engine's own
host, which the exporter fills in from the address the registration arrived from
(:func:`with_engine_host`).

A registration comes from a peer: strings are bounded and checked rather than cut (a cut
endpoint is no endpoint), wrong types refuse the kv-events part only
(``ProtocolError("bad_kv_events_config")``; the rest of the registration still counts).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from exporter.error import ProtocolError
from exporter.protocol.strings import ascii_digits

#: Longest endpoint or topic accepted, in UTF-8 bytes (vLLM's defaults are a few dozen).
MAX_ENDPOINT = 256
MAX_TOPIC = 256
MAX_PUBLISHER = 64
KIND = "bad_kv_events_config"
#: Hosts of a bind endpoint that mean "every interface of the engine's host".
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})
#: A DNS name or an IPv4 literal (IPv6 literals come in brackets and go through ``ipaddress``).
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?\Z")
#: An endpoint is printable ASCII without spaces (ZMQ endpoints are URIs).
_ENDPOINT_TEXT = re.compile(r"[!-~]+\Z")
#: IPv6 ranges whose last 32 bits are the IPv4 address a connection ends up at: mapped
#: (``::ffff:a.b.c.d``, ``IPv6Address.ipv4_mapped``), translated (``::ffff:0:a.b.c.d``, SIIT),
#: compatible (``::a.b.c.d``, deprecated; ``::`` and ``::1`` are not) and NAT64's well-known
#: prefix. 6to4 and Teredo name a gateway's IPv4 address, not the host's: left as IPv6.
_IPV4_INSIDE_IPV6 = tuple(
    ipaddress.IPv6Network(net) for net in ("::ffff:0:0:0/96", "::/96", "64:ff9b::/96")
)
#: vLLM's ``KVEventsConfig`` defaults (``vllm/config/kv_events.py``, 0.32 and 0.33), field order.
DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}


@dataclass(frozen=True, slots=True)
class KvEventsSource:
    """One engine's publisher as registered, and where a consumer connects to it.

    ``target`` / ``replay_target`` are ``host:port`` (IPv6 hosts in brackets) for a ZMQ SUB /
    DEALER socket to connect to, or None with ``note`` saying why not (an ipc endpoint, one the
    engine connects from, a wildcard host whose engine address is unknown, ...)."""

    publisher: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    target: str | None
    replay_target: str | None
    note: str | None = None
    #: The engine's host as the exporter saw it (fills a wildcard host); None: unknown.
    engine_host: str | None = None


def parse_kv_events_config(value: Any, engine_host: str | None = None) -> KvEventsSource | None:
    """The publisher a registration's ``kv_events_config`` describes; None when the engine
    publishes nothing. ``value`` is the decoded map (or, in-process, vLLM's ``KVEventsConfig``
    turned into one). ``ProtocolError`` (kind ``bad_kv_events_config``) for wrong types and
    strings past their bounds."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ProtocolError(KIND, f"kv_events_config is {type(value).__name__}, not a map")
    enabled = value.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise ProtocolError(KIND, "enable_kv_cache_events is not a boolean")
    publisher = value.get("publisher")
    if publisher is None:  # vLLM's own default
        publisher = "zmq" if enabled else "null"
    if not isinstance(publisher, str) or not 0 < len(publisher) <= MAX_PUBLISHER:
        raise ProtocolError(KIND, f"publisher is not a name of at most {MAX_PUBLISHER} characters")
    if not enabled or publisher == "null":
        return None
    endpoint = _endpoint_text(value.get("endpoint"), "endpoint")
    if endpoint is None:
        raise ProtocolError(KIND, "a publisher without an endpoint")
    replay = _endpoint_text(value.get("replay_endpoint"), "replay_endpoint")
    topic = value.get("topic", "")
    if topic is None:
        topic = ""
    if not isinstance(topic, str) or not _fits(topic, MAX_TOPIC):
        raise ProtocolError(KIND, f"topic is not text of at most {MAX_TOPIC} bytes")
    return resolve(KvEventsSource(publisher, endpoint, replay, topic, None, None), engine_host)


def with_engine_host(source: KvEventsSource, engine_host: str | None) -> KvEventsSource:
    """``source`` with its wildcard hosts filled from ``engine_host`` (the address the engine's
    registration came from, as libzmq reports it: ``10.0.0.5``, ``::1``, ``::ffff:10.0.0.5``)."""
    return resolve(source, normalise_host(engine_host))


def resolve(source: KvEventsSource, engine_host: str | None) -> KvEventsSource:
    target, note = endpoint_target(source.endpoint, source.publisher, engine_host)
    replay_target = None
    if source.replay_endpoint is not None:
        replay_target, replay_note = endpoint_target(
            source.replay_endpoint, source.publisher, engine_host
        )
        if note is None and replay_note is not None:
            note = f"replay: {replay_note}"
    return replace(
        source, target=target, replay_target=replay_target, note=note, engine_host=engine_host
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``): the publisher binds wildcard, IPv6
    and ipc/inproc endpoints and *connects* to every other one (a consumer binds those)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def endpoint_target(
    endpoint: str, publisher: str, engine_host: str | None
) -> tuple[str | None, str | None]:
    """(``host:port`` to connect to, None) or (None, why there is none).

    Every spelling of an address is that address (:func:`_host`): an IPv4 address written as
    IPv6 (``[::ffff:10.9.9.9]``, ``[::ffff:a09:909]``, ...) is judged as the IPv4 endpoint it
    is, which vLLM connects to, though its ``::`` makes vLLM bind it: listed only when it is
    the engine's own address or the wildcard, so no spelling lists another host's address."""
    if publisher != "zmq":
        return None, f"publisher {publisher!r}: its endpoints are not vLLM's ZMQ ones"
    if endpoint.startswith("ipc://"):
        return None, "an ipc endpoint: reachable on the engine's host only"
    if endpoint.startswith("inproc://"):
        return None, "an inproc endpoint: reachable inside the engine's process only"
    if not endpoint.startswith("tcp://"):
        return None, "not a tcp, ipc or inproc endpoint"
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    address = _host(bare)
    wildcard = bare in WILDCARD_HOSTS or address in WILDCARD_HOSTS
    ipv4_as_ipv6 = ":" in bare and address is not None and ":" not in address
    # ``tcp://*:0`` registers as the concrete endpoint the engine bound (its node's IP and the
    # port it got), which reads like an endpoint it connects to: one at the engine's own
    # address is taken as bound (a consumer on the engine's host binding the address it gave
    # the engine is the one case this reads wrong).
    bound_here = address is not None and address == normalise_host(engine_host)
    binds = is_bind_endpoint(endpoint) and (wildcard or not ipv4_as_ipv6)
    if not binds and not bound_here:
        if ipv4_as_ipv6:
            return None, f"IPv4 address {address} written as IPv6, not the engine's own"
        return None, "the engine connects to this address (a consumer binds it)"
    if not ascii_digits(port) or not 0 < int(port) <= 0xFFFF:
        return None, "no port to connect to"
    if wildcard:
        if engine_host is None:
            return None, "a wildcard host, and the engine's address is unknown"
        address = engine_host
    elif address is None:
        return None, "a host that is neither a name nor an address"
    shown = f"[{address}]" if ":" in address else address
    return f"{shown}:{int(port)}", None


def normalise_host(host: str | None) -> str | None:
    """An address libzmq reported as a host for a target (IPv4 inside IPv6 as IPv4); None
    for anything that is not one."""
    if not host:
        return None
    return _host(host.strip("[]"))


def _host(host: str) -> str | None:
    """One spelling per address: IPv4 dotted, IPv6 compressed in lower case, an IPv4 address
    inside IPv6 (:data:`_IPV4_INSIDE_IPV6`) as that IPv4 address; a DNS name as given; None
    for anything else (a bare number, a character no name has)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host if _HOSTNAME.match(host) and not ascii_digits(host) else None
    if isinstance(address, ipaddress.IPv6Address):
        inside = _ipv4_inside(address)
        if inside is not None:
            return str(inside)
    return str(address)


def _ipv4_inside(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if int(address) > 1 and any(address in net for net in _IPV4_INSIDE_IPV6):
        return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    return None


def _endpoint_text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ENDPOINT:
        raise ProtocolError(KIND, f"{name} is not an endpoint of at most {MAX_ENDPOINT} characters")
    if not _ENDPOINT_TEXT.match(value):
        raise ProtocolError(KIND, f"{name} has characters no endpoint has")
    return value


def _fits(text: str, limit: int) -> bool:
    try:
        return len(text.encode("utf-8")) <= limit
    except UnicodeEncodeError:  # a lone surrogate (possible in-process, never on the wire)
        return False


# -- what an engine registers (simulators) ----------------------------------------------------


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port`` (0.32, 0.33): the TCP port plus the DP
    rank (port 0 left for the OS), ``_dp<rank>`` appended to an inproc name; any other endpoint
    is a ValueError past rank 0 (an ipc publisher works on DP rank 0 only)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, _, port = endpoint.rpartition(":")
            if int(port) == 0:
                return endpoint
            return f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def publisher_config(
    base: Mapping[str, Any] | None, data_parallel_index: int
) -> dict[str, Any] | None:
    """The ``kv_events_config`` an engine at ``data_parallel_index`` registers when started with
    ``--kv-events-config`` ``base`` (vLLM's defaults for what it omits): None without a ZMQ
    publisher, else vLLM's 8 keys with the endpoints offset for the rank. (A real engine also
    turns ``tcp://*:0`` into its node's IP and bound port; a simulator binds nothing.)"""
    config = {**DEFAULTS, **dict(base or {})}
    if config["publisher"] is None:
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if not config["enable_kv_cache_events"] or config["publisher"] != "zmq":
        return None
    config["endpoint"] = offset_endpoint_port(config["endpoint"], data_parallel_index)
    config["replay_endpoint"] = offset_endpoint_port(config["replay_endpoint"], data_parallel_index)
    return {key: config[key] for key in DEFAULTS}
