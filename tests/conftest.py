"""Shared test settings: one thread per process, deterministic torch."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for the session (skipped, with the reason, where none can run)."""
    from tests import pgserver

    why = pgserver.unavailable()
    if why:
        pytest.skip(f"PostgreSQL tests: {why}")
    server = pgserver.PgServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's server, as an Optuna storage URL."""
    return pg_server.create_database()
