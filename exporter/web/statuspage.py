"""``GET /``: the incident view, rendered from the ``/status`` document.

The server renders the whole page (it works without JavaScript: a ``<noscript>`` refresh);
the inline script (``static/status.js``) then fetches ``/status`` every few seconds and rebuilds
the same sections in place, without a reload. Every string from an engine or peer is escaped
here (``html.escape``) and set with ``textContent`` there. Nothing is loaded from anywhere:
the style and script are inline, allowed by their hashes in the Content-Security-Policy
(``CSP``), which allows nothing else but ``fetch`` to this origin.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from html import escape
from importlib import resources
from string import Template
from typing import Any

from exporter.base.steps import Steps, every
from exporter.fleetstate.invariants import INVARIANTS

REFRESH_MS = 5000
LABELS = {
    "is_sleeping": "Sleep state",
    "is_scheduler_paused": "Scheduler paused",
    "get_weight_version": "Weight version",
    "checkpoint_state": "Checkpoint",
}
WORDS = {"consistent": "CONSISTENT", "inconsistent": "INCONSISTENT", "unknown": "UNKNOWN"}
DISCONNECTED = " (disconnected)"
ICONS = {"consistent": "\u2714", "inconsistent": "\u2716", "unknown": "?"}


def _static(name: str) -> str:
    return (resources.files("exporter.web") / "static" / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


STYLE = _static("status.css")
SCRIPT = _static("status.js")
TEMPLATE = Template(_static("status.html"))
CSP = (
    "default-src 'none'; "
    f"style-src {_sha256(STYLE)}; "
    f"script-src {_sha256(SCRIPT)}; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


# -- text (the same words as status.js) ------------------------------------------------------


def show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def clock(unix: float | None) -> str:
    if not unix:
        return "-"
    return time.strftime("%H:%M:%S UTC", time.gmtime(unix))


def verdict_detail(method: str, v: dict[str, Any]) -> str:
    state = v["state"]
    if state == "consistent":
        text = show(v["value"])
        if method == "is_sleeping":
            text += " (asleep or paused)" if v["value"] else " (awake)"
        return text
    if not v.get("supported", True):
        return "not asked in this attach mode"
    if v.get("outcome") == "unsupported":
        return "unsupported: no engine's vLLM has this method"
    if state == "inconsistent" and v.get("by_engine"):
        return " · ".join(f"engine {e}: {show(x)}" for e, x in v["by_engine"].items())
    if v.get("missing"):
        return "no answer from engine " + ", ".join(v["missing"])
    return v.get("error") or "no poll yet"


def _banner(method: str, v: dict[str, Any]) -> str:
    state = v["state"] if v["state"] in WORDS else "unknown"
    return (
        f'<div class="banner st-{state}" id="v-{method}" data-state="{state}" role="status">'
        f'<span class="icon" aria-hidden="true">{ICONS[state]}</span> '
        f'<span class="label">{LABELS.get(method, method)}</span> <code>{method}</code> '
        f'<strong class="word">{WORDS[state]}</strong> '
        f'<span class="detail">{escape(verdict_detail(method, v))}</span></div>'
    )


def invariant_cell(i: dict[str, Any]) -> tuple[str, bool]:
    """(text, bad) of one engine's answer for one invariant."""
    outcome = i.get("outcome")
    if outcome is None:
        return "-", False
    if outcome == "ok":
        return show(i.get("value")), False
    return outcome, outcome != "unsupported"


def version_cell(e: dict[str, Any]) -> str:
    """vLLM's version, and the Rust front end's when it is the one answering."""
    text = str(e.get("vllm_version") or "-")
    if e.get("front_end") == "rust":
        text += f" (Rust front end {e.get('rust_frontend_version') or '?'})"
    return text


def fault_tolerance_cell(ft: dict[str, Any] | None) -> tuple[str, bool]:
    """(text, bad) of one engine's fault-tolerance status: ``-`` while never reported."""
    if not ft:
        return "-", False
    status = str(ft.get("status"))
    info = ft.get("fault_info")
    return (f"{status} ({info})" if info else status), status != "healthy"


def activity_cell(a: dict[str, Any] | None) -> tuple[str, str]:
    """(text, kind) of what one engine is doing: ``has work``, ``drained`` or ``unknown``
    (kind ``busy``, ``drained``, ``unknown``), with ``running N, waiting M`` where vLLM
    published its requests (``activity`` in ``/status``; absent in an older document)."""
    a = a or {}
    drained = a.get("drained")
    kind = "unknown" if drained is None else ("drained" if drained else "busy")
    word = {"busy": "has work", "drained": "drained", "unknown": "unknown"}[kind]
    counts = [f"{k} {a[k]}" for k in ("running", "waiting") if a.get(k) is not None]
    return (f"{word} ({', '.join(counts)})" if counts else word), kind


def elastic_ep_line(o: dict[str, Any]) -> tuple[str, str]:
    """(text, kind) of one API server's elastic-EP operation; kind: its phase, or unknown."""
    phase = o.get("phase")
    if phase is None:
        return str(o.get("problem") or "not read yet"), "unknown"
    words = [f"other ({o.get('reported_phase')})" if phase == "other" else str(phase)]
    if o.get("scaling"):
        words.append("serving paused")
    if o.get("requested_data_parallel_size") is not None:
        words.append(f"to DP size {o['requested_data_parallel_size']}")
    if o.get("epoch") is not None:
        words.append(f"epoch {o['epoch']}")
    if o.get("error"):
        words.append(f"error: {o['error']}")
    return ", ".join(words), str(phase)


def elastic_ep_shown(ops: list[dict[str, Any]] | None) -> bool:
    """Whether the page shows the servers' operations: one is under way, completed or failed,
    or a server's status cannot be read; not while all are idle or have no such route."""
    return any(
        o.get("phase") not in (None, "idle")
        or (o.get("phase") is None and o.get("supported", True) and o.get("problem"))
        for o in ops or []
    )


def _elastic_ep(ops: list[dict[str, Any]] | None) -> str:
    if not ops or not elastic_ep_shown(ops):
        return ""
    lines = []
    for o in ops:
        text, kind = elastic_ep_line(o)
        lines.append(
            f'<li class="ee-{escape(kind)}" data-target="{escape(str(o.get("target")))}">'
            f"<strong>{escape(str(o.get('target')))}</strong>: {escape(text)}</li>"
        )
    return "".join(lines)


def _engine_row(e: dict[str, Any]) -> str:
    up = bool(e["up"])
    cells = [
        f"<td>{escape(str(e['engine']))}</td>",
        f'<td class="up">{"up" if up else "DOWN"}{"" if e["connected"] else DISCONNECTED}</td>',
        f"<td>{escape(str(e['state']))}</td>",
        f"<td>{age(e['seconds_since_last_success'])}</td>",
    ]
    error = ""
    for inv in INVARIANTS:
        i = e["invariants"][inv.method]
        text, bad = invariant_cell(i)
        cells.append(f"<td{' class=bad' if bad else ''}>{escape(text)}</td>")
        error = error or i.get("error") or ""
    cells.append(f"<td>{escape(version_cell(e))}</td>")
    text, bad = fault_tolerance_cell(e.get("fault_tolerance"))
    cells.append(f'<td class="ft{" bad" if bad else ""}">{escape(text)}</td>')
    text, kind = activity_cell(e.get("activity"))
    cells.append(f'<td class="act act-{kind}" data-activity="{kind}">{escape(text)}</td>')
    cells.append(f'<td class="err">{escape(error)}</td>')
    attrs = f'data-engine="{escape(str(e["engine"]))}" data-up="{"true" if up else "false"}"'
    return f"<tr {attrs}{'' if up else ' class=down'}>" + "".join(cells) + "</tr>"


def _last_action(a: dict[str, Any] | None, now: float) -> str:
    if a is None:
        return '<p class="muted">No admin action since start.</p>'
    params = ", ".join(f"{k}={show(v)}" for k, v in a["params"].items())
    head = (
        f"<p><strong>{escape(a['action'])}</strong> — "
        f'<strong class="outcome">{escape(a["outcome"].upper())}</strong> '
        f"(HTTP {a['status']}) at {clock(a['unix'])}, {age(now - a['unix'])} ago"
        f"{'; ' + escape(params) if params else ''}"
        f"{'; ' + escape(a['error']) if a['error'] else ''}</p>"
    )
    if not a["engines"]:
        return head
    rows = "".join(
        f'<tr data-engine="{escape(x["engine"])}"><td>{escape(x["engine"])}</td>'
        f"<td{'' if x['ok'] else ' class=bad'}>{'ok' if x['ok'] else 'FAILED'}</td>"
        f"<td>{escape(x['reason'] or '-')}</td>"
        f'<td class="err">{escape(x["error"] or "")}</td></tr>'
        for x in a["engines"]
    )
    return (
        head + '<table id="action-engines"><thead><tr><th>engine</th><th>result</th>'
        f"<th>reason</th><th>error</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _counters(c: dict[str, Any]) -> str:
    def pairs(d: dict[str, Any]) -> str:
        return " · ".join(f"{escape(k)} {v}" for k, v in d.items()) or "none"

    actions = " · ".join(f"{escape(name)}: {pairs(by)}" for name, by in c["actions"].items())
    items = [
        ("since", clock(c["since_unix"])),
        ("polls", str(c["polls"])),
        ("inconsistencies", pairs(c["inconsistencies"])),
        ("failed calls", f"{c['failed_calls_total']} ({pairs(c['failed_calls'])})"),
        ("admin actions", pairs(c["actions_by_outcome"])),
        ("by action", actions or "none"),
    ]
    body = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    return f'<dl class="counters">{body}</dl>'


def timeline_rows(
    history: dict[str, Any], now: float
) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """(label, [(x, state, tooltip)]) per row: one per invariant, then engines up."""
    width = history["bucket_s"] or 1
    slots = round(history["window_s"] / width) or 1
    current = int(now // width)
    rows: list[tuple[str, list[tuple[int, str, str]]]] = [(inv.method, []) for inv in INVARIANTS]
    up_row: list[tuple[int, str, str]] = []
    for entry in history["entries"]:
        x = slots - 1 - (current - int(entry["start_unix"] // width))
        if x < 0 or x >= slots:
            continue
        span = f"{clock(entry['start_unix'])}\u2013{clock(entry['end_unix'])}"
        for method, cells in rows:
            state = entry["states"].get(method)
            if state in WORDS:
                cells.append((x, state, f"{span}: {method} {state} ({entry['polls']} polls)"))
        up, expected = entry["engines_up_min"], entry["engines_expected"]
        state = "consistent" if up >= expected else ("inconsistent" if up == 0 else "unknown")
        up_row.append((x, state, f"{span}: at least {up}/{expected} engines up"))
    rows.append(("engines up", up_row))
    return rows


def _timeline(history: dict[str, Any], now: float) -> str:
    slots = round(history["window_s"] / (history["bucket_s"] or 1)) or 1
    out = ['<div class="timeline">']
    for label, cells in timeline_rows(history, now):
        rects = "".join(
            f'<rect class="st-{state}" x="{x}" y="0" width="1" height="1">'
            f"<title>{escape(tip)}</title></rect>"
            for x, state, tip in cells
        )
        out.append(
            f'<span class="tl-label">{escape(label)}</span>'
            f'<svg class="tl-bar" viewBox="0 0 {slots} 1" preserveAspectRatio="none" '
            f'role="img" aria-label="{escape(label)} over the last hour">{rects}</svg>'
        )
    out.append('<span></span><div class="tl-axis"><span>-60 min</span><span>now</span></div>')
    return "".join(out) + "</div>"


def page_steps(doc: dict[str, Any]) -> Steps[str]:
    """The page for one ``/status`` document (``exporter.web.statusdoc.status_steps``), its
    engine rows built ``ENGINES_PER_STEP`` at a time (``exporter.base.steps``: the plugin
    renders it on vLLM's event loop)."""
    rows = []
    for position, engine in enumerate(doc["engines"], 1):
        rows.append(_engine_row(engine))
        if every(position):
            yield
    now = doc["generated_unix"]
    title = "vllm-dp-exporter" + (f" — {doc['model_name']}" if doc.get("model_name") else "")
    poll = doc["last_poll"]
    up = sum(1 for e in doc["engines"] if e["up"])
    summary = (
        f"engines up {up}/{doc['engines_expected']} · connected {doc['engines_connected']}"
        f"/{doc['engines_expected']} · {escape(str(doc['attach']))} mode · "
        f"poll #{poll['number']} at {clock(poll['unix'])}"
    )
    return TEMPLATE.substitute(
        title=escape(title),
        style=STYLE,
        script=SCRIPT,
        refresh_ms=REFRESH_MS,
        version=escape(str(doc["version"])),
        summary=summary,
        banners="".join(_banner(m, v) for m, v in doc["aggregate"].items()),
        elastic_hidden="" if elastic_ep_shown(doc.get("elastic_ep_operations")) else " hidden",
        elastic_ep=_elastic_ep(doc.get("elastic_ep_operations")),
        invariant_headers="".join(f"<th>{inv.method}</th>" for inv in INVARIANTS),
        engine_rows="".join(rows),
        last_action=_last_action(doc["last_action"], now),
        counters=_counters(doc["counters"]),
        timeline=_timeline(doc["history"], now),
    )
