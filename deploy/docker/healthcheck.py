"""Docker HEALTHCHECK for the vllm-dp-exporter image: GET /healthz on the configured port.

The metrics listener is found the way the exporter finds it: `--listen HOST:PORT` (or
`--listen=HOST:PORT`) on PID 1's command line, else the VLLM_DP_EXPORTER_LISTEN environment
variable, else the default 0.0.0.0:19400. A wildcard host (0.0.0.0, ::, empty) is probed on
loopback. With a web config file (`--web-config-file`, or VLLM_DP_EXPORTER_WEB_CONFIG_FILE) that
has a tls_server_config, the probe speaks HTTPS without verifying the certificate (it checks
liveness on loopback, not identity; /healthz needs no basic auth). Exit 0 healthy, 1 unhealthy
(Docker's convention). Stdlib only.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request

DEFAULT_LISTEN = "0.0.0.0:19400"


def listen_address(argv: list[str], environ: dict[str, str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--listen" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--listen="):
            return arg.split("=", 1)[1]
    return environ.get("VLLM_DP_EXPORTER_LISTEN") or DEFAULT_LISTEN


def uses_tls(argv: list[str], environ: dict[str, str]) -> bool:
    """Whether the web config file (if any) turns TLS on: a top-level tls_server_config."""
    path = environ.get("VLLM_DP_EXPORTER_WEB_CONFIG_FILE")
    for i, arg in enumerate(argv):
        if arg == "--web-config-file" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--web-config-file="):
            path = arg.split("=", 1)[1]
    if not path:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return any(
        line.lstrip("{ ").startswith(("tls_server_config:", '"tls_server_config"'))
        for line in lines
    )


def healthz_url(listen: str, scheme: str = "http") -> str:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{int(port)}/healthz"


def pid1_argv() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def main() -> int:
    try:
        argv, environ = pid1_argv(), dict(os.environ)
        tls = uses_tls(argv, environ)
        url = healthz_url(listen_address(argv, environ), "https" if tls else "http")
        context = ssl._create_unverified_context() if tls else None
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return 0 if resp.status == 200 else 1
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
