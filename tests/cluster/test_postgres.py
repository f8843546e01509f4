"""The registry on a real PostgreSQL server (Debian's, on 127.0.0.1, started for this module): the
migrations build exactly the tables in use, and a service on it keeps runs, events, history, the
checkpoint index and its nodes across a restart. `goodput serve --db postgresql+psycopg://...` with
Ray, a drill and a SIGKILL runs in tests/cluster/test_service.py on the same kind of server."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from controller.service.migrations import HEAD, revision
from controller.service.registry import Registry, metadata
from controller.spec import parse_spec
from tests.support.postgres import PostgresServer, module_server
from tests.unit.test_service import Harness, _commit, raw_spec

pytestmark = pytest.mark.cluster
_DATABASES = itertools.count()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from module_server()


@pytest.fixture()
def database(postgres: PostgresServer) -> Iterator[str]:
    """A fresh database of the module's server for each test."""
    engine = create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    name = f"test_{next(_DATABASES)}"
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield postgres.url.rsplit("/", 1)[0] + f"/{name}"
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    engine.dispose()


def test_migrations_build_the_tables_in_use_on_postgresql(database: str) -> None:
    Registry(database).close()
    Registry(database).close()  # opening it again changes nothing
    engine = create_engine(database)
    with engine.connect() as conn:
        assert revision(conn) == HEAD
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    engine.dispose()


def test_a_service_on_postgresql_keeps_runs_events_history_and_nodes_across_a_restart(
        database: str, tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    h = Harness(database, store)
    s = h.service
    s.add(parse_spec(raw_spec("pg", dp=2, tp=2, steps=40)))
    s.add(parse_spec(raw_spec("pg-bad", dp=1, tp=2, steps=40)))
    h.until("pg", "running", "pg-bad")
    h.group("pg").finish_steps(1, 10)
    _commit(store, "pg", 10)
    h.group("pg").emit(0, "checkpoint_committed", step=10, seconds=0.1, bytes=10, uri="file://x", removed=[])
    h.group("pg").finish_steps(11, 12)
    h.group("pg-bad").emit(0, "sdc_suspect", step=3, ranks=[1], check="anomaly", clean_through_step=2,
                           evidence={"1": ["a fingerprint that differs from its replica's, as a long reason does"]})
    h.tick("pg", "pg-bad")
    quarantined = s.controller("pg-bad").quarantined[0]["node"]
    events = s.events("pg", after=-1, limit=1000)
    history = s.history("pg", after=-1, limit=1000)
    assert [e["kind"] for e in events][:2] == ["submitted", "planned"] and len(history) == 12
    s.stop()

    h2 = Harness(database, store)  # a restarted service on the same database
    s2 = h2.service
    s2.start()
    assert [r["id"] for r in s2.runs()] == ["pg", "pg-bad"]
    assert s2.events("pg", after=-1, limit=1000)[:len(events)] == events
    assert s2.history("pg", after=-1, limit=1000) == history
    assert {r["name"]: r["state"] for r in s2.cluster_view()["nodes"]}[quarantined] == "quarantined"
    assert [c["step"] for c in s2.checkpoints("pg")] == [10]
    h2.until("pg", "running")
    assert h2.group("pg").started[-1].resume_step == 10


def test_long_texts_fit_where_sqlite_never_checked_a_length(database: str) -> None:
    """SQLite ignores VARCHAR lengths; PostgreSQL enforces them. The reasons goodput writes for nodes
    (a lost node's, a release's that quotes the quarantine's) run longer than 64 characters."""
    r = Registry(database)
    reason = ("the cluster no longer shows it (its raylet or host died); listed until it comes back; "
              "released by an operator (was: sdc)")
    r.set_node("node-7", state="lost", reason=reason, run_id="pg", time=1.0)
    assert [n["reason"] for n in r.node_rows()] == [reason]
    r.close()


def test_one_service_leads_a_postgresql_registry(database: str) -> None:
    from controller.errors import RegistryBusy

    first, second = Registry(database), Registry(database)
    first.lead()
    with pytest.raises(RegistryBusy, match="one service per registry"):
        second.lead(wait_s=0.3)
    first.close()
    second.lead(wait_s=2)
    second.close()
