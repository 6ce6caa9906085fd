"""Password guessing against basic auth (``--web-config-file`` ``basic_auth_users``) while a
good scraper keeps scraping: ``python -m bench.auth_attack [--seconds S] [--cost N]
[--listener metrics|admin]``.

``serve`` runs as a subprocess (no engines are needed: ``/metrics`` answers without them, the
admin listener answers 503 once authenticated). Everything is on loopback: the good scraper
connects from 127.0.0.1, the attackers from 127.0.0.2-127.0.0.9 (the whole 127/8 is loopback
on Linux). The attack is the one basic auth must survive: first a burst of distinct passwords
over bcrypt's 72 bytes (more than a 256-entry verdict cache holds), then, for ``--seconds``,
``--workers`` connections per attacker address guessing wrong passwords for the real user and
for unknown users, with more over-long ones in between. The good scraper's credential is
verified once before the attack; it then scrapes every 0.2 s with a 10 s timeout (Prometheus's
default scrape timeout). Prints the good scraper's p50/p99/max and the attackers' status codes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import bcrypt

from bench.procs import HOST, free_address, http_get, serve_process
from bench.tail import percentile

USER, PASSWORD = "prometheus", "bench-scrape-pw"
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 10)]
OVERLONG = 400
SCRAPE_EVERY_S = 0.2
SCRAPE_TIMEOUT_S = 10.0


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@dataclass
class AttackResult:
    seconds: float
    good: list[float] = field(default_factory=list)  # seconds per good request
    good_statuses: Counter[int] = field(default_factory=Counter)  # 0: timeout or error
    attacker_statuses: Counter[int] = field(default_factory=Counter)

    def line(self) -> str:
        g = self.good
        codes = ", ".join(
            f"{k or 'timeout/error'}: {v}" for k, v in sorted(self.attacker_statuses.items())
        )
        good_codes = ", ".join(
            f"{k or 'timeout'}: {v}" for k, v in sorted(self.good_statuses.items())
        )
        return (
            f"attack {self.seconds:g} s: good scraper {len(g)} requests ({good_codes}) "
            f"p50 {percentile(g, 50) * 1e3:.1f} ms p99 {percentile(g, 99) * 1e3:.1f} ms "
            f"max {max(g, default=0.0) * 1e3:.1f} ms; "
            f"attackers {self.attacker_statuses.total()} requests ({codes})"
        )


class Client:
    """Sessions per source address against one URL."""

    def __init__(self, url: str, method: str) -> None:
        self.url, self.method = url, method
        self.sessions: dict[str, aiohttp.ClientSession] = {}

    async def ask(self, source: str, headers: dict[str, str]) -> tuple[int, float]:
        session = self.sessions.get(source)
        if session is None:
            session = self.sessions[source] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=(source, 0), limit=0),
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
            )
        started = time.perf_counter()
        try:
            async with session.request(self.method, self.url, headers=headers) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = 0
        return status, time.perf_counter() - started

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()


async def run_attack(client: Client, seconds: float, workers: int) -> AttackResult:
    result = AttackResult(seconds)
    tally = result.attacker_statuses

    async def burst(source: str, w: int, n: int) -> None:
        for i in range(n):
            tally[(await client.ask(source, basic(USER, "x" * 80 + f"{source}-{w}-{i}")))[0]] += 1

    async def guess(source: str, w: int, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            if i % 3 == 0:
                headers = basic(USER, "z" * 80 + f"{source}-{w}-{i}")
            elif i % 3 == 1:
                headers = basic(USER, f"guess-{source}-{w}-{i}")
            else:
                headers = basic(f"user-{source}-{w}-{i}", "guess")
            tally[(await client.ask(source, headers))[0]] += 1

    status, _ = await client.ask(HOST, basic(USER, PASSWORD))  # verified before the attack
    if status not in (200, 503):  # the admin listener: authenticated, but no engine
        raise RuntimeError(f"the good credential was answered {status} before the attack")
    per = OVERLONG // (len(ATTACKERS) * 5)
    await asyncio.gather(*(burst(s, w, per) for s in ATTACKERS for w in range(5)))
    until = time.monotonic() + seconds
    attackers = asyncio.gather(*(guess(s, w, until) for s in ATTACKERS for w in range(workers)))
    await asyncio.sleep(0.5)  # the guesses are queued (or refused) by now
    while time.monotonic() < until:
        status, took = await client.ask(HOST, basic(USER, PASSWORD))
        result.good.append(took)
        result.good_statuses[status] += 1
        await asyncio.sleep(SCRAPE_EVERY_S)
    await asyncio.wait_for(attackers, SCRAPE_TIMEOUT_S + 10)
    return result


def run(seconds: float, cost: int, listener: str, workers: int, log_dir: Path) -> AttackResult:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(cost)).decode()
    web = log_dir / "web.yml"
    web.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    with serve_process(
        free_address(),
        1,
        log_dir,
        poll_interval=1.0,
        admin=listener == "admin",
        extra_args=["--web-config-file", str(web)],
    ) as serve:
        deadline = time.monotonic() + 30.0
        while True:  # /healthz is open; no engine is needed
            if serve.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {serve.proc.returncode}")
            try:
                if http_get(serve.url + "/healthz", 2.0)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("serve did not answer /healthz within 30 s")
            time.sleep(0.1)
        if listener == "admin":
            assert serve.admin_url is not None
            client = Client(serve.admin_url + "/admin/reset_prefix_cache", "POST")
        else:
            client = Client(serve.url + "/metrics", "GET")

        async def main() -> AttackResult:
            try:
                return await run_attack(client, seconds, workers)
            finally:
                await client.close()

        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auth_attack", description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0, help="length of the guessing phase")
    p.add_argument("--cost", type=int, default=10, help="bcrypt cost of the user's hash")
    p.add_argument("--listener", choices=("metrics", "admin"), default="metrics")
    p.add_argument("--workers", type=int, default=20, help="connections per attacker address")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp:
        r = run(args.seconds, args.cost, args.listener, args.workers, Path(tmp))
    print(f"{args.listener} listener, bcrypt cost {args.cost}: {r.line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
