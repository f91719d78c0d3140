"""The Airflow-free core: the model and the use cases, imported by the CLI, the operators, the triggers and the UI
alike, and by the Spark driver on hosts without Airflow.

* the model: :mod:`.epochs` (life cycles and the pure decisions), :mod:`.supervision` (restart strategies),
  :mod:`.gates` (commit gates), :mod:`.exceptions`;
* one home per use case: :mod:`.retention` and :mod:`.scrub`, :mod:`.restores` (restore eligibility),
  :mod:`.stopping`, :mod:`.upgrades`, :mod:`.shadow` (shadow runs), :mod:`.provenance`, :mod:`.state` (state
  reads);
* the small parts they share: :mod:`.fs` (file systems), :mod:`.connections` (connection -> DSN),
  :mod:`.processes` (process identity), :mod:`.summary`, :mod:`.units`.

Beside it, Airflow-free as well: :mod:`airflow_arroyo.store` (the epoch store), :mod:`airflow_arroyo.runtime`
(Spark), :mod:`airflow_arroyo.examples`, :mod:`airflow_arroyo.jvm`, the ops CLI (:mod:`airflow_arroyo.cli`) and
:mod:`airflow_arroyo.testing`. The Airflow surface is the rest: ``hooks``, ``operators``, ``sensors``, ``triggers``,
``links``, ``ui``, ``submit`` and the modules that talk to Airflow (``assets``, ``config``, ``lineage``,
``metrics``, ``provider``). ``tests/test_layering.py`` holds the line.
"""
