"""The pgdecode view's web layer: a FastAPI app the API server mounts under ``/pgdecode`` (``plugin.py``).

- ``GET /`` the page (HTML); ``GET /api/status`` the same as JSON; ``GET /icon.svg`` the
  navigation icon (public).
- Authentication and authorization go through Airflow's own auth manager, whichever is
  configured: the caller's JWT (``Authorization: Bearer`` or the UI's ``_token`` cookie) is
  resolved by Airflow's ``get_user`` dependency, and only the sources of DAGs the auth manager
  lets the user read are shown (``get_authorized_dag_ids``). Without a valid token the JSON
  endpoint answers 401 (403 for a malformed token) and a browser asking for the page is sent to
  the auth manager's login page, which brings it back.
- The handlers are plain functions: FastAPI runs them in its thread pool, so a slow source never
  holds the API server's event loop.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from airflow_provider_pgdecode.ui.page import render_page
from airflow_provider_pgdecode.ui.status import SourceStatus

ICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="#3182ce" stroke-width="2">'
    '<ellipse cx="12" cy="5" rx="8" ry="3"/><path d="M4 5v6c0 1.7 3.6 3 8 3s8-1.3 8-3V5"/>'
    '<path d="M4 11v6c0 1.7 3.6 3 8 3"/><path d="M16 16l3 3 3-3M19 13v6"/></svg>'
)


def airflow_base_path() -> str:
    """The URL path Airflow is served under (``[api] base_url``'s path, ``/`` by default)."""
    from airflow.api_fastapi.app import get_cookie_path

    return get_cookie_path()


def source_statuses(user: Any) -> tuple[list[SourceStatus], list[str]]:
    """The statuses of the sources of the DAGs ``user`` may read, and what kept a part of the
    page from being read (the sources file's problems)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.configuration import conf
    from airflow.utils.session import create_session

    from airflow_provider_pgdecode.ui.readers import configured_sources, gather, pgdecode_dag_ids, recent_runs
    from airflow_provider_pgdecode.utils.config import pgdecode_int

    problems: list[str] = []
    with create_session() as session:
        allowed = get_auth_manager().get_authorized_dag_ids(user=user, method="GET", session=session)
        runs = recent_runs(session, pgdecode_dag_ids(session, allowed))
    try:
        configured = [ref for ref in configured_sources(conf.get("core", "dags_folder")) if ref.dag_id in allowed]
    except Exception as exc:  # the page still shows what ran
        configured = []
        problems.append(f"the sources file: {exc}")
    return gather(runs, configured=configured, max_lag_bytes=pgdecode_int("max_lag_bytes")), problems


def create_app() -> FastAPI:
    app = FastAPI(title="pgdecode", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def login_first(request: Request, exc: HTTPException) -> Response:
        """A browser without a (valid) session goes to the auth manager's login page and back."""
        if exc.status_code == 401 and "text/html" in request.headers.get("accept", ""):
            from airflow.api_fastapi.app import get_auth_manager

            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(get_auth_manager().get_url_login(next_url=target), status_code=303)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/", response_class=HTMLResponse)
    def page(user: GetUserDep) -> HTMLResponse:
        now = datetime.now(UTC)
        sources, problems = source_statuses(user)
        html = render_page(sources, base=airflow_base_path(), now=now, problems=problems)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/api/status")
    def status(user: GetUserDep) -> JSONResponse:
        now = datetime.now(UTC)
        sources, problems = source_statuses(user)
        body = {"generated": now.isoformat(), "sources": [s.to_dict() for s in sources], "problems": problems}
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/icon.svg")
    def icon() -> Response:
        return Response(ICON, media_type="image/svg+xml")

    return app


__all__ = ["create_app"]
