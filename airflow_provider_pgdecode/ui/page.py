"""The pgdecode view as one server-rendered HTML page: plain HTML and CSS, the lag chart as inline
SVG, no script. Every value shown also sits in a ``data-`` attribute of its element, for tests
and for scraping. A pure function of the sources' statuses (``status.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import quote

from airflow_provider_pgdecode.decoding.lsn import describe_bytes
from airflow_provider_pgdecode.ui.status import LagPoint, SourceStatus

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px;color:#1a202c;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:17px;margin:0}h3{font-size:14px;margin:14px 0 6px}
.muted{color:#718096;font-size:12px}.source{border:1px solid #e2e8f0;border-radius:8px;padding:12px 16px;margin:14px 0}
.head{display:flex;gap:12px;align-items:center;flex-wrap:wrap}.badge{border-radius:10px;padding:2px 9px;font-size:12px;font-weight:600}
.healthy{background:#c6f6d5;color:#22543d}.parked,.lagging,.unreserved{background:#feebc8;color:#7b341e}
.lost,.missing,.unreachable{background:#fed7d7;color:#822727}
table{border-collapse:collapse;font-size:13px;margin-top:4px}th,td{border-bottom:1px solid #edf2f7;padding:4px 10px;text-align:left}
th{color:#4a5568;font-weight:600;white-space:nowrap}td{white-space:nowrap}td.wrap{white-space:normal;max-width:300px}td.num{text-align:right;font-variant-numeric:tabular-nums}.facts{display:flex;gap:22px;flex-wrap:wrap;font-size:13px}
.facts b{display:block;font-size:15px}.problem{color:#9b2c2c;font-size:12px}a{color:#2b6cb0}
"""


def age(seconds: float | None) -> str:
    """A duration in words (``4 min``)."""
    if seconds is None:
        return "unknown"
    seconds = max(seconds, 0.0)
    for limit, unit, per in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / per:.0f} {unit}"
    return f"{seconds / 86400:.1f} d"


def when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC") if moment is not None else "–"


def lag_chart(points: Sequence[LagPoint], width: int = 520, height: int = 140) -> str:
    """The slot's lag over the recent runs as an SVG polyline with a dot per run."""
    if not points:
        return '<p class="muted" data-lag-points="0">No health check recorded a lag yet.</p>'
    pad_left, pad, top = 70, 10, 12
    peak = max(max(p.lag_bytes for p in points), 1)
    span = max(len(points) - 1, 1)
    coords = []
    for i, point in enumerate(points):
        x = pad_left + (width - pad_left - pad) * (i / span if len(points) > 1 else 0.5)
        y = top + (height - top - 22) * (1 - point.lag_bytes / peak)
        coords.append((x, y, point))
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in coords)
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#3182ce" data-run-id="{escape(p.run_id)}" '
        f'data-lag-bytes="{p.lag_bytes}"><title>{escape(p.run_id)}: {escape(describe_bytes(p.lag_bytes))}</title></circle>'
        for x, y, p in coords
    )
    base = height - 22
    return (
        f'<svg class="lag-chart" width="{width}" height="{height}" role="img" data-lag-points="{len(points)}" '
        f'aria-label="slot lag over the last {len(points)} runs">'
        f'<line x1="{pad_left}" y1="{base}" x2="{width - pad}" y2="{base}" stroke="#cbd5e0"/>'
        f'<line x1="{pad_left}" y1="{top}" x2="{pad_left}" y2="{base}" stroke="#cbd5e0"/>'
        f'<text x="{pad_left - 6}" y="{top + 4}" font-size="11" text-anchor="end" fill="#4a5568">{escape(describe_bytes(peak))}</text>'
        f'<text x="{pad_left - 6}" y="{base}" font-size="11" text-anchor="end" fill="#4a5568">0</text>'
        f'<text x="{pad_left}" y="{height - 6}" font-size="11" fill="#4a5568">{escape(when(points[0].at))}</text>'
        f'<text x="{width - pad}" y="{height - 6}" font-size="11" text-anchor="end" fill="#4a5568">'
        f"{escape(when(points[-1].at))}</text>"
        f'<polyline fill="none" stroke="#3182ce" stroke-width="2" points="{line}"/>{dots}</svg>'
    )


def _runs_url(base: str, dag_id: str, run_id: str | None = None) -> str:
    url = f"{base.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs"
    return f"{url}/{quote(run_id, safe='')}" if run_id else url


def _parked_cell(parked: Mapping[str, Any] | None, limit: int = 70) -> str:
    """Since which LSN the table waits and the start of why (all of it on hover)."""
    if not parked:
        return ""
    reason = str(parked.get("reason") or "")
    short = reason if len(reason) <= limit else reason[: limit - 1] + "…"
    return f'<span title="{escape(reason)}">since {escape(str(parked.get("since_lsn")))}: {escape(short)}</span>'


def source_section(source: SourceStatus, base: str) -> str:
    info = source.slot_state.info or {}
    lag = info.get("lag_bytes")
    e = escape
    facts = [
        ("slot", source.slot, "slot"),
        ("plugin", info.get("plugin") or source.plugin or "–", "plugin"),
        ("wal_status", info.get("wal_status") or "–", "wal-status"),
        ("active", "yes" if info.get("active") else "no" if info else "–", "active"),
        ("lag now", describe_bytes(lag) if lag is not None else "–", "lag"),
        ("confirmed", info.get("confirmed_flush_lsn") or "–", "confirmed-lsn"),
        ("server WAL", info.get("current_lsn") or "–", "current-lsn"),
        ("parked tables", str(len(source.parked)), "parked"),
        ("quarantined", str(source.quarantined), "quarantined"),
    ]
    facts_html = "".join(
        f'<div data-fact="{key}"><b>{e(str(value))}</b>{e(label)}</div>' for label, value, key in facts
    )
    slot_error = (
        f'<p class="problem" data-slot-error>{e(source.slot_state.error)}</p>' if source.slot_state.error else ""
    )
    problems = "".join(f'<p class="problem" data-problem>{e(p)}</p>' for p in source.problems)

    table_rows = "".join(
        f'<tr data-table="{e(t.name)}" data-newest-commit="{e(t.newest_commit.isoformat() if t.newest_commit else "")}" '
        f'data-freshness-seconds="{"" if t.freshness_seconds is None else f"{t.freshness_seconds:.0f}"}" '
        f'data-delta-version="{"" if t.delta_version is None else t.delta_version}" '
        f'data-quarantined="{t.quarantined}" data-parked="{"yes" if t.parked else "no"}">'
        f"<td>{e(t.name)}</td><td>{e(age(t.freshness_seconds))}</td><td>{e(when(t.newest_commit))}</td>"
        f"<td>{e(when(t.merged_at))}</td><td class=num>{'' if t.delta_version is None else t.delta_version}</td>"
        f"<td class=num>{t.last_rows}</td><td class=num>{t.quarantined}</td>"
        f"<td class=wrap>{_parked_cell(t.parked)}</td></tr>"
        for t in source.tables
    )
    tables = (
        "<table class=tables><tr><th>table</th><th>freshness</th><th>newest change committed</th><th>merged into Delta</th>"
        f"<th>Delta version</th><th>rows (last merge)</th><th>quarantined</th><th>parked</th></tr>{table_rows}</table>"
        if source.tables
        else '<p class="muted">No table merged yet.</p>'
    )

    run_rows = []
    for run in source.runs[:10]:
        batches = "; ".join(
            f"{b.start_lsn} → {b.end_lsn}: {b.changes} changes in {b.transactions} tx"
            + (f", bounded by {b.bounded_by}" if b.bounded_by else "")
            for b in run.batches
        )
        if run.drained_batches:
            batches += f" (+{run.drained_batches} drained)"
        run_rows.append(
            f'<tr data-run-id="{e(run.run_id)}" data-state="{e(run.state or "")}">'
            f'<td><a target="_top" href="{e(_runs_url(base, source.dag_id, run.run_id))}">{e(run.run_id)}</a></td>'
            f"<td>{e(run.state or '–')}</td><td>{e(when(run.start_date))}</td>"
            f"<td class=num>{'' if run.lag_bytes is None else e(describe_bytes(run.lag_bytes))}</td>"
            f"<td class=wrap>{e(batches or 'no batch')}</td><td class=wrap>{e(', '.join(run.merged_tables))}</td></tr>"
        )
    runs = (
        "<table class=runs><tr><th>run</th><th>state</th><th>started</th><th>lag at start</th><th>batches</th>"
        f"<th>tables merged</th></tr>{''.join(run_rows)}</table>"
        if run_rows
        else '<p class="muted">No run yet.</p>'
    )

    requests = "".join(
        f'<li data-snapshot-request="{e(str(r.get("id")))}">{e(str(r.get("mode")))} of '
        f"{e(', '.join(r.get('tables') or []))} (filed {e(str(r.get('created')))}): {e(str(r.get('progress')))}</li>"
        for r in source.snapshot_requests
    )
    requests_html = f"<ul>{requests}</ul>" if requests else '<p class="muted">None pending.</p>'

    return (
        f'<section class="source" data-dag-id="{e(source.dag_id)}" data-slot="{e(source.slot)}" '
        f'data-health="{e(source.health)}" data-lag-bytes="{"" if lag is None else int(lag)}" '
        f'data-confirmed-lsn="{e(str(info.get("confirmed_flush_lsn") or ""))}">'
        f'<div class="head"><h2>{e(source.dag_id)}</h2><span class="badge {e(source.health)}">{e(source.health)}</span>'
        f'<a target="_top" href="{e(_runs_url(base, source.dag_id))}">DAG runs →</a>'
        f'<span class="muted">{e(source.postgres_conn_id or "")} · Delta {e(source.delta_root or "–")}</span></div>'
        f'<div class="facts">{facts_html}</div>{slot_error}{problems}'
        f"<h3>Slot lag over the last {len(source.lag)} runs</h3>{lag_chart(source.lag)}"
        f"<h3>Tables</h3>{tables}<h3>Last runs</h3>{runs}<h3>Pending snapshot requests</h3>{requests_html}</section>"
    )


def render_page(
    sources: Sequence[SourceStatus],
    *,
    base: str,
    now: datetime,
    problems: Sequence[str] = (),
    refresh_seconds: int = 30,
) -> str:
    """The whole page. ``base``: Airflow's URL path (links to DAG runs go there); ``problems``:
    what kept a part of the page from being read."""
    body = (
        "".join(source_section(s, base) for s in sources)
        if sources
        else '<p class="muted" data-empty>No pgdecode DAG has run yet, and no sources file names one (or none you may read).</p>'
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{refresh_seconds}"><title>pgdecode</title><style>{STYLE}</style></head>'
        f'<body><h1>pgdecode</h1><p class="muted" data-generated="{now.isoformat()}">{len(sources)} source(s) · '
        f"as of {escape(when(now))} · refreshes every {refresh_seconds} s · "
        f'<a href="api/status">JSON</a></p>'
        + "".join(f'<p class="problem" data-problem>{escape(p)}</p>' for p in problems)
        + f"{body}</body></html>"
    )


__all__ = ["age", "lag_chart", "render_page"]
