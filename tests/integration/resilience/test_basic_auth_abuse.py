"""Basic auth (``--web-config-file`` ``basic_auth_users``) under abuse, over real HTTP on both
listeners: password guessing from many loopback addresses never delays a scraper whose
credential was already verified, failed guesses are throttled per source before bcrypt runs,
and unknown users cost as much bcrypt time as known ones.

Different client addresses come from binding the client side to other loopback addresses
(127.0.0.2 ... : the whole 127/8 is loopback on Linux).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from exporter.web.admin import ADMIN_KEY, RESET_PATH
from exporter.web.basicauth import BASIC_AUTH_KEY, MAX_CONCURRENT, MAX_WAITING
from tests.harness.service import Service, ServiceFactory
from tests.harness.tls import write_web_config

GOOD = ("prometheus", "scrape-pw-4f1c")
SECOND = ("grafana", "second-pw-9d2e")
SCRAPER = "127.0.0.1"
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 10)]
WORKERS_PER_ATTACKER = 20
ATTACK_S = 3.0
#: Distinct over-long credentials sent first (more than a 256-entry verdict cache holds).
OVERLONG = 400
BURST_WORKERS = 5
#: Prometheus's default scrape timeout; a good scrape must never come near it.
SCRAPE_TIMEOUT_S = 10.0
#: Generous liveness bound on every good answer while the attack runs.
GOOD_WITHIN_S = 2.5
#: Failed attempts a source may make per window before 429 (``AuthThrottle``'s default).
FAILURE_LIMIT = 5


def basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


@dataclass
class Target:
    """One protected listener: where to send a request and what an authenticated one gets."""

    url: str
    method: str
    authenticated: int  # the status of an authenticated request (the admin: no engine, 503)
    sessions: dict[str, aiohttp.ClientSession] = field(default_factory=dict)

    def session(self, source: str) -> aiohttp.ClientSession:
        if source not in self.sessions:
            self.sessions[source] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=(source, 0), limit=0),
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
            )
        return self.sessions[source]

    async def ask(self, source: str, headers: dict[str, str]) -> tuple[int, float, str | None]:
        """(status, seconds, Retry-After) of one request from ``source``."""
        started = time.perf_counter()
        async with self.session(source).request(self.method, self.url, headers=headers) as resp:
            await resp.read()
            return resp.status, time.perf_counter() - started, resp.headers.get("Retry-After")


Protected = Callable[[str, int], Awaitable[tuple[Service, Target]]]


@pytest.fixture
async def protected(service_factory: ServiceFactory, tmp_path: Path) -> AsyncIterator[Protected]:
    """``await protected(listener, rounds)`` → a service whose web config has two basic-auth
    users hashed at bcrypt cost ``rounds`` (and no admin token), and the ``Target`` of its
    ``metrics`` or ``admin`` listener."""
    made: list[Target] = []

    async def build(listener: str, rounds: int) -> tuple[Service, Target]:
        path = write_web_config(
            tmp_path / f"web-{listener}-{rounds}.yml", None, users=dict([GOOD, SECOND]),
            rounds=rounds,
        )  # fmt: skip
        svc = await service_factory(
            1, web_config_file=str(path), audit=[].append if listener == "admin" else None
        )
        if listener == "admin":
            assert svc.admin_url is not None
            target = Target(svc.admin_url + RESET_PATH, "POST", 503)
        else:
            target = Target(svc.url + "/metrics", "GET", 200)
        made.append(target)
        return svc, target

    yield build
    for target in made:
        for session in target.sessions.values():
            await session.close()


async def guess(target: Target, source: str, headers: dict[str, str], tally: Counter[int]) -> None:
    try:
        status, _, _ = await target.ask(source, headers)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        status = 0
    tally[status] += 1


async def overlong_burst(target: Target, tally: Counter[int]) -> None:
    """``OVERLONG`` distinct passwords over bcrypt's 72 bytes for the real user, from every
    attacker address (more than a 256-entry verdict cache holds)."""

    async def worker(source: str, w: int) -> None:
        for i in range(OVERLONG // (len(ATTACKERS) * BURST_WORKERS)):
            await guess(target, source, basic(GOOD[0], "x" * 80 + f"{source}-{w}-{i}"), tally)

    await asyncio.gather(*(worker(s, w) for s in ATTACKERS for w in range(BURST_WORKERS)))


async def guessing(target: Target, until: float, tally: Counter[int]) -> None:
    """Until ``until``, ``WORKERS_PER_ATTACKER`` connections from every attacker address
    guessing wrong passwords for the real user and for users that do not exist, with more
    over-long passwords in between."""

    async def worker(source: str, w: int) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            if i % 3 == 0:
                headers = basic(GOOD[0], "z" * 80 + f"{source}-{w}-{i}")
            elif i % 3 == 1:
                headers = basic(GOOD[0], f"guess-{source}-{w}-{i}")
            else:
                headers = basic(f"user-{w}-{i}", "guess")
            await guess(target, source, headers, tally)

    await asyncio.gather(*(worker(s, w) for s in ATTACKERS for w in range(WORKERS_PER_ATTACKER)))


@pytest.mark.parametrize("listener", ["metrics", "admin"])
async def test_guessing_never_delays_a_scraper_whose_credential_was_verified(
    protected: Protected, listener: str
) -> None:
    _, target = await protected(listener, 10)  # cost 10: ~80 ms of bcrypt per check
    status, _, _ = await target.ask(SCRAPER, basic(*GOOD))
    assert status == target.authenticated  # verified once, before the attack

    statuses: Counter[int] = Counter()
    await asyncio.wait_for(overlong_burst(target, statuses), SCRAPE_TIMEOUT_S)
    until = time.monotonic() + ATTACK_S
    attackers = asyncio.create_task(guessing(target, until, statuses))
    good: list[tuple[int, float]] = []
    await asyncio.sleep(0.5)  # the guesses are queued (or refused) by now
    while time.monotonic() < until:
        try:
            status, seconds, _ = await target.ask(SCRAPER, basic(*GOOD))
        except asyncio.TimeoutError:
            status, seconds = 0, SCRAPE_TIMEOUT_S
        good.append((status, seconds))
        await asyncio.sleep(0.1)
    await asyncio.wait_for(attackers, SCRAPE_TIMEOUT_S + 5)

    worst = max(seconds for _, seconds in good)
    assert worst < GOOD_WITHIN_S, f"a good scrape took {worst:.2f} s during the attack: {good}"
    assert all(status == target.authenticated for status, _ in good), good
    assert len(good) >= 3, good
    # Each attacker address got at most its failure budget of 401s; then 429s.
    assert statuses[401] <= len(ATTACKERS) * FAILURE_LIMIT, statuses
    assert statuses[429] > 0 and set(statuses) <= {401, 429}, statuses

    # Afterwards: the verified credential is answered even from a throttled address, ...
    status, _, _ = await target.ask(ATTACKERS[0], basic(*GOOD))
    assert status == target.authenticated
    # ... another user's first request from an address that failed nothing is served, ...
    status, _, _ = await target.ask(SCRAPER, basic(*SECOND))
    assert status == target.authenticated
    # ... and the same first request from a throttled address waits (bcrypt is not run for it).
    status, _, retry = await target.ask(ATTACKERS[1], basic(GOOD[0], GOOD[1] + "-typo"))
    assert status == 429 and retry is not None and 1 <= int(retry) <= 60


def bcrypt_runs(svc: Service, listener: str) -> int:
    """How many bcrypt checks the ``listener``'s basic auth has run so far."""
    if listener == "admin":
        assert svc.admin_runner is not None
        auth = svc.admin_runner.app[ADMIN_KEY].basic_auth
    else:
        auth = svc.app[BASIC_AUTH_KEY]
    assert auth is not None
    return auth.bcrypt_checks


@pytest.mark.parametrize("listener", ["metrics", "admin"])
async def test_failed_guesses_are_throttled_per_source_before_bcrypt(
    protected: Protected, listener: str
) -> None:
    svc, target = await protected(listener, 10)
    attacker, other = ATTACKERS[0], ATTACKERS[1]
    # Concurrent guesses from one address: never more bcrypt runs than its failure budget.
    answers = await asyncio.gather(
        *(target.ask(attacker, basic(GOOD[0], f"guess-{i}")) for i in range(30))
    )
    counts = Counter(status for status, _, _ in answers)
    assert counts[401] <= FAILURE_LIMIT and counts[429] >= 30 - FAILURE_LIMIT, counts
    assert all(retry is not None and int(retry) >= 1 for s, _, retry in answers if s == 429)
    # Once throttled, a guess is answered without a bcrypt run behind it.
    runs = bcrypt_runs(svc, listener)
    for i in range(10):
        status, _, retry = await target.ask(attacker, basic(GOOD[0], f"later-{i}"))
        assert status == 429 and retry is not None
    assert bcrypt_runs(svc, listener) == runs
    # Passwords over bcrypt's 72 bytes are failures too, answered without bcrypt.
    for i in range(FAILURE_LIMIT):
        status, _, _ = await target.ask(other, basic(GOOD[0], "y" * 73 + str(i)))
        assert status == 401
    assert (await target.ask(other, basic(GOOD[0], "y" * 100)))[0] == 429
    # Requests without credentials are told to authenticate, never throttled.
    for _ in range(FAILURE_LIMIT + 2):
        assert (await target.ask(ATTACKERS[2], {}))[0] == 401
    assert (await target.ask(ATTACKERS[2], basic(*GOOD)))[0] == target.authenticated


async def test_bcrypt_queue_is_bounded_and_the_rest_answered_at_once(
    protected: Protected,
) -> None:
    """Guesses from many addresses at once (each within its own budget): only a few wait for
    bcrypt, the others are told to retry at once; a verified scraper is answered meanwhile."""
    _, target = await protected("metrics", 10)
    assert (await target.ask(SCRAPER, basic(*GOOD)))[0] == 200
    sources = [f"127.0.1.{i}" for i in range(1, 41)]
    guesses = asyncio.gather(*(target.ask(s, basic(GOOD[0], f"guess-{s}")) for s in sources))
    status, seconds, _ = await target.ask(SCRAPER, basic(*GOOD))
    answers = await asyncio.wait_for(guesses, SCRAPE_TIMEOUT_S)
    assert status == 200 and seconds < GOOD_WITHIN_S, (status, seconds)
    counts = Counter(s for s, _, _ in answers)
    bound = MAX_CONCURRENT + MAX_WAITING
    assert bound <= len(sources) // 2  # a small queue: most of these are refused at once
    assert counts[401] <= bound and counts[429] >= len(sources) - bound, counts
    assert all(retry == "1" for s, _, retry in answers if s == 429), answers
    slowest_401 = max(t for s, t, _ in answers if s == 401)
    assert all(t < slowest_401 for s, t, _ in answers if s == 429)  # not queued behind bcrypt


def _min_seconds(samples: list[tuple[int, float, str | None]]) -> float:
    assert all(status == 401 for status, _, _ in samples), samples
    return min(seconds for _, seconds, _ in samples)


@pytest.mark.parametrize("rounds", [8, 12])
async def test_unknown_users_take_as_long_as_known_ones(protected: Protected, rounds: int) -> None:
    """A wrong password for a configured user and any password for an unknown user cost the
    same bcrypt time, whatever cost the configured hashes use."""
    _, target = await protected("metrics", rounds)
    known: list[tuple[int, float, str | None]] = []
    unknown: list[tuple[int, float, str | None]] = []
    for i in range(3):  # each address stays within its failure budget
        known.append(await target.ask(ATTACKERS[0], basic(GOOD[0], f"wrong-{i}")))
        unknown.append(await target.ask(ATTACKERS[1], basic(f"nobody-{i}", f"wrong-{i}")))
    ratio = _min_seconds(unknown) / _min_seconds(known)
    # The old dummy hash (cost 10) made this ~4 (cost 8) or ~0.25 (cost 12).
    assert 0.5 < ratio < 2.0, (ratio, known, unknown)
