"""Airflow sensors of airflow-arroyo (import the modules directly; this package imports nothing)."""
