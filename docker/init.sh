#!/usr/bin/env bash
# airflow-init: migrate Airflow's metadata DB and the epoch store, write the admin's password.
set -euo pipefail
airflow db migrate
python - <<'PY'
import os

from airflow_arroyo.store import EpochStore

dsn = os.environ["AIRFLOW_CONN_ARROYO_DEFAULT"]
store = EpochStore(dsn)
print("epoch store: migrations applied:", store.migrate() or "none (up to date)")
store.close()
PY
# The simple auth manager's users (admin) and their passwords, shared with the api-server.
printf '{"admin": "%s"}\n' "${ARROYO_ADMIN_PASSWORD:-admin}" > "${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE}"
echo "airflow-init: done"
