"""The pgdecode view in Airflow's UI: an Airflow plugin (``plugin.py``) that mounts a small
FastAPI app in the API server (``app.py``) and adds it to the navigation. It shows what the
pipeline recorded (``readers.py`` reads it, ``status.py`` assembles it, ``page.py`` draws it).
docs/ui.md."""
