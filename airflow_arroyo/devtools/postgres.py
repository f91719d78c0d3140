"""A throwaway PostgreSQL server started from the machine's own binaries.

Used by the embedded default (``scripts/dev.sh demo``), the test suite and the benchmarks. It runs
``initdb`` and ``pg_ctl`` from ``pg_config --bindir`` (or ``$ARROYO_PG_BINDIR``). PostgreSQL refuses
to run as root, so when this process is root the server runs as the ``postgres`` system user
(``runuser``), in a data folder owned by that user.

    with ThrowawayPostgres() as pg:
        print(pg.dsn)        # postgresql://arroyo@127.0.0.1:PORT/arroyo
        pg.restart()         # e.g. to prove that clients recover
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ThrowawayPostgres", "pg_bindir"]


def pg_bindir() -> Path:
    env = os.environ.get("ARROYO_PG_BINDIR")
    if env:
        return Path(env)
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], check=True, capture_output=True, text=True).stdout.strip()
        if (Path(out) / "initdb").exists():
            return Path(out)
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    raise RuntimeError(
        "no PostgreSQL server binaries found (initdb, pg_ctl): install Debian's postgresql package "
        "(apt-get install postgresql) or set ARROYO_PG_BINDIR to the folder holding initdb"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayPostgres:
    """A private PostgreSQL cluster in a temporary folder, trust auth on 127.0.0.1 only."""

    def __init__(self, base_dir: str | Path | None = None, port: int | None = None,
                 user: str = "arroyo", database: str = "arroyo", max_connections: int = 300) -> None:
        self.bindir = pg_bindir()
        self._owns_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="arroyo-pg-"))
        self.data_dir = self.base_dir / "data"
        self.log_file = self.base_dir / "postgres.log"
        self.port = port or _free_port()
        self.user = user
        self.database = database
        self.max_connections = max_connections
        self._as_root = os.geteuid() == 0

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str) -> None:
        cmd = [str(a) for a in args]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def init(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            shutil.chown(self.base_dir, "postgres", "postgres")
            os.chmod(self.base_dir, 0o755)
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", self.user,
                      "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C")
            with open(self.data_dir / "postgresql.conf", "a") as conf:
                conf.write(
                    f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\n"
                    f"unix_socket_directories = '{self.base_dir}'\n"
                    f"max_connections = {self.max_connections}\nfsync = off\n"
                    "synchronous_commit = off\nfull_page_writes = off\nshared_buffers = 128MB\n"
                )

    def start(self) -> None:
        self.init()
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_file),
                  "-w", "-t", "60", "start")
        self._wait_ready()
        self._ensure_database()

    def stop(self, mode: str = "fast") -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_file),
                  "-w", "-t", "60", "start")
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = subprocess.run([str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                                  capture_output=True)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL on port {self.port} not ready; see {self.log_file}")
            time.sleep(0.1)

    def _ensure_database(self) -> None:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            conn.close()

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create another database on this server and return its DSN; with ``template``, a copy of that
        database (which nobody may be connected to meanwhile), e.g. one migrated once for many tests."""
        import psycopg2
        from psycopg2 import sql

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
                if template is not None:
                    query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
                cur.execute(query)
        finally:
            conn.close()
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{name}"

    def cleanup(self) -> None:
        try:
            self.stop("immediate")
        finally:
            if self._owns_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()
