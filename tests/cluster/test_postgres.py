"""The registry on a real PostgreSQL server (Debian's, on 127.0.0.1, started for this module): the
migrations build exactly the tables in use, and a service on it keeps runs, events, history, the
checkpoint index and its nodes across a restart. `goodput serve --db postgresql+psycopg://...` with
Ray, a drill and a SIGKILL runs in tests/cluster/test_service.py on the same kind of server."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from controller.service.migrations import HEAD, revision
from controller.service.registry import Registry, metadata
from controller.spec import parse_spec
from tests.support.postgres import PostgresServer, module_server
from tests.unit.test_service import Harness, _commit, raw_spec

if TYPE_CHECKING:
    from tests.support.serve import Serve

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


def test_a_leader_sees_a_standby_only_while_one_offers_itself_on_postgresql(database: str) -> None:
    """A standby that reaches the cluster holds a shared advisory lock while it does; the leader's
    check reads it (a cut-off leader yields sooner when one waits), and a standby's lock goes with it."""
    leader, standby, other = Registry(database), Registry(database), Registry(database)
    leader.lead()
    assert leader.still_leads() and not leader.standby_waiting
    standby.offer_standby(True)
    other.offer_standby(True)
    assert leader.still_leads() and leader.standby_waiting
    standby.offer_standby(False)
    other.close()
    assert leader.still_leads() and not leader.standby_waiting
    assert standby.lead(wait_s=0) is False, "the standby's mark is not the leader's lock"
    for r in (leader, standby):
        r.close()


def _lock_sessions(url: str) -> list[int]:
    """The backend pids holding the leading service's advisory lock."""
    engine = create_engine(url)
    with engine.connect() as conn:
        pids = [row[0] for row in conn.execute(text(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND ((classid::bigint << 32) | objid::bigint) = :key"), {"key": Registry.LEAD_KEY})]
    engine.dispose()
    return pids


def _terminate(url: str, pid: int) -> None:
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
    engine.dispose()


def test_a_leader_whose_lock_session_ends_knows_it_and_writes_nothing_more(database: str) -> None:
    """The lock's session is ended from the server's side (what a restart, a failover or a proxy's idle
    kill does): the leader's next check says so, and its writes are refused from then on, while a
    second registry takes the lock."""
    from controller.errors import NotLeading

    first, second = Registry(database), Registry(database)
    first.lead()
    assert first.still_leads() and _lock_sessions(database) != []
    (pid,) = _lock_sessions(database)
    _terminate(database, pid)
    assert second.lead(wait_s=5)
    assert not first.still_leads() and first.lost_lead
    with pytest.raises(NotLeading, match="lost the registry's lock"):
        first.set_node("node-1", state="lost", reason="x", run_id=None, time=1.0)
    assert second.still_leads()
    first.close()
    second.close()


def test_a_leader_cut_off_from_its_database_leaves_the_lock_check_in_flight_alone(database: str) -> None:
    """(Seen in test_silent_faults: a leader cut off from its PostgreSQL died of SIGSEGV as it stopped,
    in its lock check's query: Registry.close had closed that session, which psycopg does not guard
    against a query in flight in another thread.) Through a forwarder that goes dark: the check gets
    no answer, the leader knows it lost the lock, and close() returns without touching the session
    the check still waits on (it ends with the process)."""
    from urllib.parse import urlsplit

    from tests.support.relay import Relay

    server = urlsplit(database)
    assert server.hostname is not None and server.port is not None
    with Relay((server.hostname, server.port)) as proxy:
        registry = Registry(database.replace(f"@{server.hostname}:{server.port}/", f"@127.0.0.1:{proxy.port}/"))
        assert registry.lead(wait_s=5)
        session = registry._leadership.connection.dbapi_connection
        assert registry.still_leads(), "through the forwarder, before the cut"
        proxy.go_dark()
        assert not registry.still_leads(timeout_s=1.0)
        assert registry.lost_lead is not None and "did not answer" in registry.lost_lead
        registry.close()
        assert not session.closed, "the session was closed under the lock check's query"


def _serve(tmp_path: Path, name: str, database: str, *args: str) -> "Serve":
    from tests.support.serve import Serve

    return Serve(tmp_path / name, tmp_path / f"{name}.log", "--db", database, "--local-nodes", "1",
                 "--gpus-per-node", "1", "--spares", "0", "--repair-after-s", "off", *args)


def test_two_services_starting_together_on_an_empty_database_one_leads_one_stands_by(
        database: str, tmp_path: Path) -> None:
    """Both start at once with --standby on an empty PostgreSQL database: the schema is made once,
    by the one that leads (migrations run only under the lock), and the other waits as its standby.
    Neither crashes."""
    services = [_serve(tmp_path, f"s{i}", database, "--standby") for i in range(2)]
    try:
        for s in services:
            s.launch()
        deadline = time.monotonic() + 120
        while not (sum("API on" in s.text() for s in services) == 1
                   and sum("standby: another goodput serve leads" in s.text() for s in services) == 1):
            for s in services:
                assert s.proc is not None and s.proc.poll() is None, s.text()[-3000:]
            assert time.monotonic() < deadline, [s.text()[-1500:] for s in services]
            time.sleep(0.3)
        time.sleep(2)
        assert all(s.proc is not None and s.proc.poll() is None for s in services)
        engine = create_engine(database)
        with engine.connect() as conn:
            assert revision(conn) == HEAD
        engine.dispose()
    finally:
        for s in services:
            s.stop()


def test_a_leader_that_loses_its_lock_stops_before_the_standby_drives(database: str, tmp_path: Path) -> None:
    """The leader's lock session is ended with pg_terminate_backend while a standby waits. The leader
    notices within its check interval and exits non-zero within 10 s, touching no run; the standby
    takes the lock but drives nothing until the leader has stopped, then leads."""
    leader, standby = _serve(tmp_path, "leader", database), _serve(tmp_path, "standby", database, "--standby")
    try:
        leader.start()
        offset = standby.launch()
        standby.wait_text(offset, "standby: another goodput serve leads")
        (pid,) = _lock_sessions(database)
        _terminate(database, pid)
        ended = time.monotonic()
        assert leader.proc is not None and standby.proc is not None
        while leader.proc.poll() is None:
            assert "leading now" not in standby.text()[offset:], "the standby drove while the old leader did"
            assert time.monotonic() - ended < 10, leader.text()[-3000:]
            time.sleep(0.1)
        print(f"leader exited {time.monotonic() - ended:.1f} s after its lock's session ended")
        assert leader.proc.returncode == 4, leader.text()[-3000:]
        assert "lost the registry's lock" in leader.text()
        standby.wait_api(offset, timeout_s=120)
        assert "leading now, after" in standby.text()[offset:]
    finally:
        leader.stop()
        standby.stop()
