#!/usr/bin/env bash
# One entry point for a fresh machine: installs what the project needs (idempotently), then
#   scripts/dev.sh demo [args]   runs the main job on the embedded default
#                                (Spark local mode, a throwaway Postgres, airflow standalone)
#   scripts/dev.sh test [args]   runs ruff, mypy and the whole test suite (args go to pytest)
#   scripts/dev.sh setup         only installs
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

log() { printf '[dev.sh] %s\n' "$*" >&2; }

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
if ! command -v pg_config >/dev/null 2>&1 || [ ! -x "$(pg_config --bindir 2>/dev/null)/initdb" ]; then
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
fi
if [ "${1:-}" = "test" ]; then
  command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
  command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
  [ -d /usr/share/fonts/truetype/liberation ] || need_apt+=(fonts-liberation)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    log "installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    log "missing system packages (install them as root): ${need_apt[*]}"
  fi
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$(command -v "$cand"); break
    fi
  done
fi
[ -n "$PY" ] || { log "Python 3.11 is required"; exit 1; }

stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  log "installing Python packages into .venv (pinned by constraints.txt)"
  "$PY" -m pip install -q --disable-pip-version-check uv
  "$PY" -m uv venv -q --allow-existing --python "$PY" .venv
  "$PY" -m uv pip install -q --python .venv/bin/python -c constraints.txt -e ".[dev,pyspark,demo]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

# The lowest apache-spark provider release pyproject.toml allows, beside the installed one, for the contract test
# of the provider internals the submit operator uses (tests/airflow/test_spark_provider_contract.py).
lowest_spark_provider=$(.venv/bin/python -c 'import re, tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(re.search(r">=\s*([\d.]+)", next(x for x in d if x.startswith("apache-airflow-providers-apache-spark"))).group(1))')
contract_dir=".cache/provider-contract/$lowest_spark_provider"
if [ ! -d "$contract_dir/airflow" ]; then
  log "installing apache-airflow-providers-apache-spark==$lowest_spark_provider into $contract_dir (contract test)"
  "$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check uv
  "$PY" -m uv pip install -q --no-deps --python .venv/bin/python --target "$contract_dir" \
    "apache-airflow-providers-apache-spark==$lowest_spark_provider"
fi

# The JVM artifacts the provider hands to Spark (Kafka connector, S3A) and the test broker's jars, each set
# pinned by its pom (airflow_arroyo/jvm/deps/*/pom.xml) and resolved by Maven into $ARROYO_JVM_CACHE (default
# .cache/jvm) once per version of the pom; never committed.
.venv/bin/python -m airflow_arroyo.jvm.artifacts resolve

export PATH="$ROOT/.venv/bin:$PATH"
export PYSPARK_PYTHON="$ROOT/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$ROOT/.venv/bin/python"

cmd=${1:-}
shift || true
case "$cmd" in
  setup) ;;
  demo) exec .venv/bin/python -m airflow_arroyo.devtools.embedded "$@" ;;
  test)
    # The suite starts hundreds of Python processes (Spark's Python workers, drivers, Airflow's
    # components); without bytecode caches each compiles what it imports again (about half of an
    # import's CPU). Keep the caches in the venv even where PYTHONDONTWRITEBYTECODE is set.
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX="$ROOT/.venv/pycache"
    # The suite starts dozens of short-lived JVMs (Spark drivers killed and restored, Kafka, a standalone
    # cluster), each doing little work: C2's compilations and G1's threads cost them more CPU than they give
    # back. Tests only (the java launcher reads this); a pipeline run outside them keeps the JVM's defaults.
    export JDK_JAVA_OPTIONS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC${JDK_JAVA_OPTIONS:+ $JDK_JAVA_OPTIONS}"
    # And they start from a class-data-sharing archive of the classes a driver loads, trained once per JVM, jars
    # and options (airflow_arroyo/devtools/jvm_archive.py); without one when training fails.
    log "JVM class-data-sharing archive"
    cds=$(.venv/bin/python -m airflow_arroyo.devtools.jvm_archive ensure) || cds=""
    [ -z "$cds" ] || export JDK_JAVA_OPTIONS="$JDK_JAVA_OPTIONS $cds"
    log "ruff"; .venv/bin/ruff check airflow_arroyo dags plugins tests benchmarks
    log "mypy"; .venv/bin/mypy
    log "pytest"; exec .venv/bin/python -m pytest -p no:cacheprovider "$@" ;;
  *) echo "usage: scripts/dev.sh {demo|test|setup} [args]" >&2; exit 2 ;;
esac
