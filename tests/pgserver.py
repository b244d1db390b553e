"""A throw-away PostgreSQL cluster for the tests: initdb in a temp dir, a 127.0.0.1 port.

`PgServer.start()` finds the server binaries (PATH, then Debian's /usr/lib/postgresql/*/bin),
runs them as the `postgres` user when the tests run as root (the server refuses root), and
opens a Unix socket in its own folder (trust, for the set-up) and a 127.0.0.1 port with
password authentication (what the tests connect to, so a wrong password fails as on a real
server). `create_database()` makes a fresh database per test; `stop()` removes everything.
`unavailable()` says why no server can run here, or None.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER, PASSWORD = "nfabric", "s3cret-pw"


def _bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(dirs[-1]).parent if dirs else None


def unavailable() -> str | None:
    """Why no test server can run here (None if one can)."""
    if _bindir() is None:
        return "no PostgreSQL server binaries (initdb) on this machine"
    if importlib.util.find_spec("psycopg") is None:
        return "the psycopg driver is not installed (pip install 'nfabric_cli[pg]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        self.bindir = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="nfabric-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.port = _free_port()
        self.as_root = os.geteuid() == 0
        self._count = 0

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        return subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True,
                              timeout=120, cwd="/")

    def start(self) -> PgServer:
        assert self.bindir is not None
        self.sock.mkdir()
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            for p in (self.root, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        b = self.bindir
        self._run(str(b / "initdb"), "-D", str(self.data), "-U", "postgres", "--no-sync",
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8")
        opts = (f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run(str(b / "pg_ctl"), "-D", str(self.data), "-o", opts,
                  "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        self.psql(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}' CREATEDB")
        return self

    def psql(self, sql: str) -> str:
        return self._run(str(self.bindir / "psql"), "-h", str(self.sock), "-p", str(self.port),
                         "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qAt",
                         "-c", sql).stdout

    def url(self, db: str, password: str = PASSWORD, port: int | None = None) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{port or self.port}/{db}"

    def create_database(self) -> str:
        self._count += 1
        name = f"t{self._count}"
        self.psql(f"CREATE DATABASE {name} OWNER {USER}")
        return self.url(name)

    def stop(self) -> None:
        try:
            if self.data.exists():
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                          "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
