"""``python -m airflow_arroyo.jvm [JAR]``: rebuild the provider's jar from its Java sources."""

import sys
from pathlib import Path

from airflow_arroyo.jvm import JAR, build_jar

print(build_jar(Path(sys.argv[1]) if len(sys.argv) > 1 else JAR))
