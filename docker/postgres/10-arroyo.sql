-- Runs once, when the postgres container initialises its data volume (docker-entrypoint-initdb.d).
-- Two databases on one server: `airflow` (Airflow's metadata, created by POSTGRES_DB) and `arroyo`
-- (the epoch store), each with its own role.
CREATE ROLE arroyo LOGIN PASSWORD 'arroyo';
CREATE DATABASE arroyo OWNER arroyo;
