"""Airflow operators of airflow-arroyo (import the modules directly; this package imports nothing)."""
