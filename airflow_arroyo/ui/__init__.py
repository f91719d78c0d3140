"""The Airflow UI plugin: a read-only FastAPI app over the epoch store, mounted by Airflow at ``/arroyo``.

Modules, each doing one thing:

* ``plugin`` - :class:`~airflow_arroyo.ui.plugin.ArroyoPlugin`, what Airflow loads (``fastapi_apps`` and
  an ``external_views`` entry in the navigation). Importing it builds nothing: the app is made on first use.
* ``app`` - :func:`~airflow_arroyo.ui.app.create_app`, the FastAPI app factory (HTML pages, JSON API,
  Airflow authentication on every route).
* ``queries`` - read-only, parameterised, paginated queries over a read-only connection pool.
* ``health`` - pure: which warnings a pipeline deserves (failing, overdue, stale heartbeat...).
* ``charts`` - pure: server-side SVG (checkpoint history, per-stage epoch timeline).
* ``format`` - pure: human-readable durations, sizes and epoch ranges.
* ``store_source`` - where the epoch store's DSN comes from (the ``arroyo_default`` connection).

Nothing here imports Airflow at package import time.
"""
