"""What a state file may say before a restarted exporter believes a word of it.

The file decides which ``client_index`` the exporter sends to engines that never handshake
again, and an engine trusts that index blindly: one out of range kills its output thread until
the engine restarts (``docs/protocol.md`` A.1). So the file is read like any untrusted input:
bounded in size, only a regular file, parsed without letting deep nesting escape, and every
field checked against what this exporter could have written for these engines (its input
address, engine count and ranks, each engine's identity and output address, the one slot of
owner mode or the one slot a front end gives every engine in relay mode, types, string
lengths). Any mismatch rejects the whole file (``InvalidState``): half a file is not a state.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from exporter.protocol.handshake import (
    MAX_REGISTRATION_STRING,
    REGISTRATION_FACTS,
    registration_facts,
)
from exporter.protocol.pushes import FT_STATE_VALUES, MAX_FAULT_INFO, FaultStatus
from exporter.protocol.utility import MAX_CLIENT_INDEX

STATE_VERSION = 1
#: Longest address the file may name (``tcp://`` + a DNS name + port fits many times over).
MAX_ADDRESS = 512
#: Bytes a file may have: a header plus, per engine, an entry with every string at its longest
#: (a version of escaped non-ASCII characters, an address); the writer never comes close.
HEADER_BYTES = 8 * 1024
#: One engine entry as ``write_state`` writes it at its largest: the addresses and slot, plus
#: every registration fact (a string fact of ``MAX_REGISTRATION_STRING`` characters outside
#: the basic plane is 12 bytes a character in JSON's ``\\ud83d\\ude00`` escapes).
ENTRY_BYTES = (
    2 * 1024
    + sum(
        len(key) + 8 + (12 * MAX_REGISTRATION_STRING if kind is str else 24)
        for key, kind in REGISTRATION_FACTS
    )
    + 12 * MAX_FAULT_INFO  # fault_tolerance's fault_info (its other fields: in the 2 KiB)
)
TOP_KEYS = frozenset(
    {
        "version",
        "input_address",
        "engine_count",
        "start_rank",
        "handshake_address",
        "upstream_handshake_address",
        "coordinator_stats_address",
        "engines",
    }
)
#: The addresses a file records beside its engines: for the operator, and the relay's DP
#: coordinator publication (its request counts after a restart: no INIT is seen again).
RECORDED_ADDRESSES = (
    "handshake_address",
    "upstream_handshake_address",
    "coordinator_stats_address",
)
ENTRY_KEYS = frozenset(
    {
        "engine_index",
        "identity",
        "client_index",
        "output_address",
        "vllm_version",
        "enable_sleep_mode",
        "registration",
        "fault_tolerance",
    }
)
#: ``fault_tolerance`` of an entry: the engine's last status (null: none since its handshake).
FAULT_KEYS = frozenset({"status", "fault_info", "since_unix"})


FACT_KEYS = frozenset(key for key, _ in REGISTRATION_FACTS)


class InvalidState(Exception):
    """The state file cannot be believed; the message says why (one line, bounded)."""


@dataclass(frozen=True, slots=True)
class SlotRecord:
    engine_index: int
    identity_hex: str
    client_index: int
    output_address: str
    vllm_version: str | None = None
    enable_sleep_mode: bool | None = None
    #: The registration facts it kept (``exporter.protocol.handshake.REGISTRATION_FACTS``).
    facts: tuple[tuple[str, Any], ...] = ()
    #: Its last fault-tolerance status (None: none since its handshake) ...
    fault_status: FaultStatus | None = None
    #: ... when the file says (a file of an older exporter, or a value that cannot be
    #: believed, does not: the status is then not known, never healthy).
    fault_status_known: bool = True


@dataclass(frozen=True, slots=True)
class StateExpectation:
    """What a state file must say to apply to this exporter."""

    input_address: str
    engine_count: int
    start_rank: int
    #: Engine index → (identity in hex, output address) of every expected engine.
    engines: Mapping[int, tuple[str, str]]
    #: Owner mode: the exporter's slot on every engine (0). None in relay mode: the slot the
    #: front end's INIT implied, at most ``MAX_CLIENT_INDEX`` and the same on every engine.
    fixed_slot: int | None

    @property
    def size_limit(self) -> int:
        return HEADER_BYTES + ENTRY_BYTES * self.engine_count


def read_bounded(path: str, limit: int) -> bytes | None:
    """The file's bytes; None when there is no file. InvalidState when it is not a regular file
    (a directory, a FIFO that would block the start-up), cannot be opened or exceeds ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidState(f"cannot open it: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidState("it is not a regular file")
        if info.st_size > limit:
            raise InvalidState(f"{info.st_size} bytes, more than the {limit} it can have")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise InvalidState(f"more than the {limit} bytes it can have")
        return b"".join(chunks)
    except OSError as exc:
        raise InvalidState(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def parse_state(data: bytes, expect: StateExpectation) -> list[SlotRecord]:
    """Every engine the file records, each checked against ``expect``; InvalidState else."""
    try:
        state = json.loads(data)
    except RecursionError:
        raise InvalidState("nested too deeply to be a state file") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise InvalidState(f"not JSON: {_short(str(exc))}") from None
    if not isinstance(state, dict):
        raise InvalidState("not a JSON object")
    _known_keys(state, TOP_KEYS, "the file")
    version = state.get("version")
    if not _is_int(version) or version != STATE_VERSION:
        raise InvalidState(f"unknown version {_short(version)}")
    written_for = _address(state, "input_address", required=True)
    if written_for != expect.input_address:
        raise InvalidState(
            f"written for input {_short(written_for)}, this exporter's is {expect.input_address} "
            "(another exporter's file, or --fixed-base-port / --advertise-host changed)"
        )
    for key, mine in (("engine_count", expect.engine_count), ("start_rank", expect.start_rank)):
        if key in state and (not _is_int(state[key]) or state[key] != mine):
            raise InvalidState(f"written for {key} {_short(state[key])}, this exporter's is {mine}")
    for key in RECORDED_ADDRESSES:
        _address(state, key, required=False)
    entries = state.get("engines")
    if not isinstance(entries, list):
        raise InvalidState(f"engines is {_short(entries)}, not a list")
    if len(entries) > expect.engine_count:
        raise InvalidState(
            f"{len(entries)} engines listed, this exporter has {expect.engine_count}"
        )
    records: list[SlotRecord] = []
    for entry in entries:
        record = _entry(entry, expect)
        if any(r.engine_index == record.engine_index for r in records):
            raise InvalidState(f"engine {record.engine_index} is listed twice")
        first = records[0] if records else record
        if record.client_index != first.client_index:  # owner mode checked each against 0
            raise InvalidState(
                f"engines {first.engine_index} and {record.engine_index} have different "
                f"client_index values ({first.client_index} and {record.client_index}); one "
                "front end gives every engine the same slot"
            )
        records.append(record)
    return records


def recorded_addresses(data: bytes) -> dict[str, str]:
    """The ``RECORDED_ADDRESSES`` of a file ``parse_state`` believed (each checked there)."""
    state = json.loads(data)
    return {key: state[key] for key in RECORDED_ADDRESSES if isinstance(state.get(key), str)}


def _entry(entry: Any, expect: StateExpectation) -> SlotRecord:
    if not isinstance(entry, dict):
        raise InvalidState(f"an engine entry is {_short(entry)}, not an object")
    index = entry.get("engine_index")
    if not _is_int(index) or index not in expect.engines:
        first, last = expect.start_rank, expect.start_rank + expect.engine_count - 1
        raise InvalidState(
            f"engine_index {_short(index)} is not one of this exporter's engines {first}..{last}"
        )
    _known_keys(entry, ENTRY_KEYS, f"engine {index}'s entry")
    identity, output = expect.engines[index]
    if entry.get("identity") != identity:
        raise InvalidState(
            f"engine {index}'s identity is {_short(entry.get('identity'))}, not {identity}"
        )
    if entry.get("output_address") != output:
        raise InvalidState(
            f"engine {index}'s output_address is {_short(entry.get('output_address'))}, "
            f"this exporter's is {output}"
        )
    slot = entry.get("client_index")
    if not _is_int(slot) or slot < 0:
        raise InvalidState(f"engine {index}'s client_index {_short(slot)} is not a slot")
    if expect.fixed_slot is not None and slot != expect.fixed_slot:
        raise InvalidState(
            f"engine {index}'s client_index {slot} is not this exporter's slot "
            f"{expect.fixed_slot} (the only one owner mode has)"
        )
    if slot > MAX_CLIENT_INDEX:
        raise InvalidState(
            f"engine {index}'s client_index {_short(slot)} is beyond any front end's clients "
            f"(at most {MAX_CLIENT_INDEX})"
        )
    version = entry.get("vllm_version")
    if version is not None and (
        not isinstance(version, str) or len(version) > MAX_REGISTRATION_STRING
    ):
        raise InvalidState(f"engine {index}'s vllm_version {_short(version)} is not a version")
    sleep_mode = entry.get("enable_sleep_mode")
    if sleep_mode is not None and not isinstance(sleep_mode, bool):
        raise InvalidState(f"engine {index}'s enable_sleep_mode {_short(sleep_mode)} is no bool")
    registration = entry.get("registration", {})
    if not isinstance(registration, dict) or len(registration) > len(REGISTRATION_FACTS):
        raise InvalidState(f"engine {index}'s registration {_short(registration)} is not a map")
    _known_keys(registration, FACT_KEYS, f"engine {index}'s registration")
    facts = registration_facts(registration)
    if len(facts) != len(registration):
        raise InvalidState(f"engine {index}'s registration {_short(registration)} has bad values")
    if "fault_tolerance" not in entry:
        return SlotRecord(index, identity, slot, output, version, sleep_mode, facts, None, False)
    status = fault_record(entry["fault_tolerance"])
    known = status is not None or entry["fault_tolerance"] is None
    return SlotRecord(index, identity, slot, output, version, sleep_mode, facts, status, known)


def fault_record(value: Any) -> FaultStatus | None:
    """An entry's ``fault_tolerance`` as ``write_state`` writes it; None for null and for a
    value that cannot be believed (the caller tells the two apart: the latter is unknown)."""
    if not isinstance(value, dict) or set(value) != FAULT_KEYS:
        return None
    status, info, since = value["status"], value["fault_info"], value["since_unix"]
    if status not in FT_STATE_VALUES or type(since) not in (int, float) or not since >= 0:
        return None
    if info is not None:
        try:
            if not isinstance(info, str) or len(info.encode()) > MAX_FAULT_INFO:
                return None
        except UnicodeEncodeError:  # a lone surrogate from a JSON escape: no exposition takes it
            return None
    return FaultStatus(status, info, float(since))


def _is_int(value: object) -> TypeGuard[int]:
    return type(value) is int  # not bool, not float


def _address(state: dict[str, Any], key: str, *, required: bool) -> str | None:
    value = state.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ADDRESS:
        raise InvalidState(f"{key} {_short(value)} is not an address")
    return value


def _known_keys(obj: dict[str, Any], known: frozenset[str], what: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise InvalidState(f"{what} has unknown fields {_short(unknown)}")


def _short(value: Any, limit: int = 60) -> str:
    """A bounded repr for a log line (a file can hold 10,000-character strings)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit
        text = f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
