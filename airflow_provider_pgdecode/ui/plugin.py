"""The Airflow plugin of the pgdecode view, registered by the provider (the ``airflow.plugins``
entry point, and ``plugins`` in the provider info).

It mounts the view's FastAPI app (``app.py``) in the API server under ``/pgdecode`` and adds
"pgdecode" to the UI's navigation, which shows the page inside Airflow's UI (an external view
with a ``url_route``: ``/plugin/pgdecode``). Every Airflow process loads plugins; the app, and with
it FastAPI and Airflow's API security, is built only when asked for (the API server asks).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.plugins_manager import AirflowPlugin

URL_PREFIX = "/pgdecode"


def view_href() -> str:
    """The page's path under Airflow's ``[api] base_url``."""
    from urllib.parse import urlparse

    from airflow.configuration import conf

    base = urlparse(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")
    return f"{base}{URL_PREFIX}/"


class _LazyApps:
    """``fastapi_apps``, built on first access (from the class, as provider plugins are read, or
    from an instance, as entry-point plugins are)."""

    def __init__(self) -> None:
        self._apps: list[dict[str, Any]] | None = None

    def __get__(self, obj: object, owner: type | None = None) -> list[dict[str, Any]]:
        if self._apps is None:
            from airflow_provider_pgdecode.ui.app import create_app

            self._apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "pgdecode"}]
        return self._apps


class PgDecodeViewPlugin(AirflowPlugin):
    """The pgdecode view: sources, slots, lag, tables, runs (docs/ui.md)."""

    name = "pgdecode"
    fastapi_apps = _LazyApps()
    external_views = [
        {
            "name": "pgdecode",
            "href": view_href(),
            "url_route": "pgdecode",
            "destination": "nav",
            "icon": f"{view_href()}icon.svg",
        }
    ]


__all__ = ["PgDecodeViewPlugin"]
