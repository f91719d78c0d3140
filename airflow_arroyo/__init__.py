"""airflow-arroyo: Arroyo/Flink-style checkpoint epochs for PySpark Structured Streaming, controlled by Airflow.

Layers (dependencies point one way): ``epochs`` (the model, no I/O) <- ``store`` (PostgreSQL)
<- ``runtime`` (Spark) <- ``hooks``/``operators``/``sensors``/``triggers``/``ui`` (Airflow).
Heavy modules are imported lazily by their users; this package root imports nothing heavy.
"""

__version__ = "0.2.0"

__all__ = ["__version__"]
