"""The JVM artifacts the provider needs beyond the jars pyspark ships, by Maven coordinates, and where they are.

Three sets, each declared by a pom in ``deps/<set>/pom.xml``, the one pinned list both Maven and this module read:

* ``spark`` (:data:`SPARK`): what a Spark application the provider starts gets on its class path: Spark's Kafka
  connector for this pyspark's Spark and Scala versions and Hadoop's S3A file system (``hadoop-aws``) for its
  Hadoop, with the AWS SDK modules S3A uses instead of the SDK's 690 MB ``bundle``. What pyspark already ships
  is excluded in the pom: a second copy of a class on the class path loads whichever comes first.
* ``kafka`` (:data:`KAFKA`): the Kafka broker the tests and the demo run (``airflow_arroyo.devtools.kafka``), in a
  folder of its own: it must never meet Spark's class path.
* ``minicluster`` (:data:`MINICLUSTER`): Hadoop's mini-cluster (HDFS and YARN on loopback) for
  ``scripts/yarn_proof.py`` only, a class path of its own too. Not one of :data:`DEFAULT_SETS`: ``resolve`` without
  names (``scripts/dev.sh``, CI) leaves it alone; the script resolves it by name.

``scripts/dev.sh`` (setup, demo and test alike) resolves each of :data:`DEFAULT_SETS` once with Maven (:func:`resolve`:
``mvn dependency:copy-dependencies``) into ``<cache>/<set>/``, where ``<cache>`` is ``$ARROYO_JVM_CACHE`` or
``.cache/jvm`` at the repository's root, and stamps the folder with the hash of its pom: a changed pom resolves
again, a folder without its pom's stamp counts as missing. :func:`airflow_arroyo.jvm.master_conf` hands the
``spark`` set's jars to local and standalone masters in ``spark.jars``; for YARN and Kubernetes,
:func:`packages_conf` is what a user sets (docs/clusters.md). ``python -m airflow_arroyo.jvm.artifacts`` prints
the coordinates and those settings; ``... resolve [SET ...]`` resolves what is missing (default: :data:`DEFAULT_SETS`).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_ENV", "DEFAULT_SETS", "DEPS", "KAFKA", "MINICLUSTER", "SETS", "SPARK", "Coordinate", "cache_dir",
           "coordinates", "exclusions", "jar_folder", "packages_conf", "pom", "pom_hash", "resolve", "resolved",
           "resolved_jars", "stamp"]

#: the jars a Spark application gets (``spark.jars`` on local and standalone masters)
SPARK = "spark"
#: the Kafka broker's jars (a class path of their own)
KAFKA = "kafka"
#: Hadoop's mini-cluster, HDFS and YARN on loopback (``scripts/yarn_proof.py``; a class path of its own)
MINICLUSTER = "minicluster"
SETS = (SPARK, KAFKA, MINICLUSTER)
#: what ``resolve`` without names resolves (``scripts/dev.sh``, hence CI): the mini-cluster's 114 MB only on request
DEFAULT_SETS = (SPARK, KAFKA)
DEPS = Path(__file__).with_name("deps")
#: overrides the folder the sets are resolved into (default: ``.cache/jvm`` at the repository's root)
CACHE_ENV = "ARROYO_JVM_CACHE"
_DEFAULT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "jvm"
_NS = {"m": "http://maven.apache.org/POM/4.0.0"}
_STAMP_PREFIX = ".pom-"
#: the plugin version the poms pin (``pluginManagement``); named in full so that Maven never picks another
_COPY_GOAL = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Coordinate:
    """A dependency a pom declares: ``group:artifact:version``."""

    group: str
    artifact: str
    version: str

    def __str__(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"


def pom(name: str = SPARK) -> Path:
    """The pom declaring the set ``name`` (:data:`SETS`)."""
    if name not in SETS:
        raise ValueError(f"no JVM artifact set {name!r}: one of {', '.join(SETS)}")
    return DEPS / name / "pom.xml"


def _text(element: ET.Element, tag: str, properties: dict[str, str]) -> str:
    value = (element.findtext(f"m:{tag}", default="", namespaces=_NS) or "").strip()
    for key, prop in properties.items():
        value = value.replace(f"${{{key}}}", prop)
    if "${" in value:
        raise ValueError(f"{tag} {value!r}: an unknown property (declare it in the pom's <properties>)")
    return value


def _parsed(name: str) -> tuple[ET.Element, dict[str, str]]:
    root = ET.parse(pom(name)).getroot()
    props = root.find("m:properties", _NS)
    properties = {} if props is None else {
        child.tag.split("}", 1)[-1]: (child.text or "").strip() for child in props}
    return root, properties


def coordinates(name: str = SPARK) -> list[Coordinate]:
    """The dependencies the set's pom declares (what Maven resolves, with their own dependencies, minus the pom's
    exclusions), in the pom's order."""
    root, properties = _parsed(name)
    return [Coordinate(_text(dep, "groupId", properties), _text(dep, "artifactId", properties),
                       _text(dep, "version", properties))
            for dep in root.iterfind("m:dependencies/m:dependency", _NS)]


def exclusions(name: str = SPARK) -> list[str]:
    """The ``group:artifact`` patterns (``*`` for any artifact of a group) the set's pom excludes, each once."""
    root, properties = _parsed(name)
    out: list[str] = []
    for exclusion in root.iterfind("m:dependencies/m:dependency/m:exclusions/m:exclusion", _NS):
        pattern = f"{_text(exclusion, 'groupId', properties)}:{_text(exclusion, 'artifactId', properties)}"
        if pattern not in out:
            out.append(pattern)
    return out


def packages_conf() -> dict[str, str]:
    """What a YARN or Kubernetes application sets to have Spark resolve the ``spark`` set itself (Ivy, at
    submission): ``spark.jars.packages`` and ``spark.jars.excludes``. Building the jars into the image (Maven at
    image build time, then ``spark.jars``) is the dependable route (docs/clusters.md)."""
    return {"spark.jars.packages": ",".join(str(c) for c in coordinates(SPARK)),
            "spark.jars.excludes": ",".join(exclusions(SPARK))}


def pom_hash(name: str = SPARK) -> str:
    """The first 16 hex digits of the SHA-256 of the set's pom: a resolved folder's stamp names it."""
    return hashlib.sha256(pom(name).read_bytes()).hexdigest()[:16]


def cache_dir() -> Path:
    """The folder holding the resolved sets: ``$ARROYO_JVM_CACHE``, else ``.cache/jvm`` at the repository's root."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else _DEFAULT_CACHE


def jar_folder(name: str = SPARK) -> Path:
    """Where the set ``name`` is resolved: ``<cache>/<name>``."""
    pom(name)  # a known set
    return cache_dir() / name


def stamp(name: str = SPARK) -> Path:
    """The file that marks the set's folder as resolved from its pom as it is now."""
    return jar_folder(name) / f"{_STAMP_PREFIX}{pom_hash(name)}"


def resolved(name: str = SPARK) -> bool:
    """Whether the set's folder holds what its pom declares now (its stamp is there)."""
    return stamp(name).is_file()


def resolved_jars(name: str = SPARK) -> list[Path]:
    """The set's jars, sorted by name; none (logged at debug) when the folder is missing or was resolved from
    another version of the pom: ``scripts/dev.sh setup`` resolves it."""
    if not resolved(name):
        log.debug("JVM artifacts %r not resolved in %s (no stamp %s): run scripts/dev.sh setup", name,
                  jar_folder(name), stamp(name).name)
        return []
    return sorted(jar_folder(name).glob("*.jar"))


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One resolution of the cache at a time (two ``scripts/dev.sh`` runs may start together)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve(name: str = SPARK, *, mvn: str | None = None) -> Path:
    """Resolve the set with Maven into :func:`jar_folder` unless its stamp is there; the folder. The jars land in
    a folder beside it first, which replaces the old one only once Maven has succeeded, so that a failed or
    interrupted run leaves no half-filled folder that looks resolved."""
    target = jar_folder(name)
    with _locked(target.parent):
        if resolved(name):
            return target
        found = mvn or shutil.which("mvn")
        if found is None:
            raise FileNotFoundError("mvn not found: resolving the provider's JVM artifacts needs Maven "
                                    "(apt-get install maven)")
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            cmd = [found, "-q", "-B", "-f", str(pom(name)), _COPY_GOAL, f"-DoutputDirectory={staging}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            (staging / f"{_STAMP_PREFIX}{pom_hash(name)}").touch()
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m airflow_arroyo.jvm.artifacts [show | resolve [SET ...]]``: print the sets' coordinates and the
    settings for YARN and Kubernetes, or resolve the sets named (default: DEFAULT_SETS) that are missing."""
    parser = argparse.ArgumentParser(prog="python -m airflow_arroyo.jvm.artifacts", description=main.__doc__)
    parser.add_argument("action", nargs="?", choices=["show", "resolve"], default="show")
    parser.add_argument("sets", nargs="*", metavar="SET", help=f"with resolve: {', '.join(SETS)} "
                        f"(default: {', '.join(DEFAULT_SETS)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sets) - set(SETS))
    if unknown:
        parser.error(f"no set {', '.join(unknown)}: the sets are {', '.join(SETS)}")
    if args.action == "resolve":
        for name in args.sets or DEFAULT_SETS:
            if not resolved(name):
                folder = resolve(name)
                print(f"{name}: resolved {len(list(folder.glob('*.jar')))} jars into {folder}", file=sys.stderr)
        return 0
    for name in SETS:
        how = ("scripts/dev.sh setup" if name in DEFAULT_SETS
               else f"python -m airflow_arroyo.jvm.artifacts resolve {name}")
        state = f"resolved in {jar_folder(name)}" if resolved(name) else f"not resolved ({how})"
        print(f"# {name}: {state}")
        for coordinate in coordinates(name):
            print(coordinate)
    print("# YARN and Kubernetes (spark-defaults.conf; docs/clusters.md)")
    for key, value in packages_conf().items():
        print(f"{key} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
