"""Submitting a pipeline's driver with the apache-spark provider (Airflow side): what goes into its
``spark-submit`` per cluster manager (:mod:`~airflow_arroyo.submit.deploy`), and every use of the provider's
``SparkSubmitHook`` internals, in one module with a contract test per member
(:mod:`~airflow_arroyo.submit.provider`)."""
