"""The registry's schema comes from Alembic migrations: what they build is exactly the tables the
registry's queries use, and registries made by earlier goodput versions are upgraded in place with
their data."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from controller.service.migrations import HEAD, LEGACY_TABLES, revision
from controller.service.registry import Registry, metadata, sqlite_url

pytestmark = pytest.mark.timing  # a leader's lease taken within 5 s; answers asked for within 0.1-5 s


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), metadata)


def test_a_fresh_registry_is_built_by_the_migrations_and_matches_the_tables_in_use(tmp_path: Path) -> None:
    url = sqlite_url(str(tmp_path))
    Registry(url).close()
    assert _diff(url) == []
    with create_engine(url).connect() as conn:
        assert revision(conn) == HEAD


def _made_by_todays_code_before_migrations(url: str, *, history_times: bool) -> None:
    """What goodput wrote before Alembic: create_all of the tables of that time (runs without the team
    the migrations added since), no alembic_version (and, older still, history without its time columns)."""
    engine = create_engine(url)
    metadata.create_all(engine, tables=[metadata.tables[name] for name in LEGACY_TABLES])
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE runs DROP COLUMN team"))
        if not history_times:
            conn.execute(text("ALTER TABLE history DROP COLUMN started_at"))
            conn.execute(text("ALTER TABLE history DROP COLUMN ended_at"))
        conn.execute(text("INSERT INTO runs (id, seq, name, spec, state, created_at, attempt, step, updated_at) "
                          "VALUES ('old', 1, 'old', '{}', 'succeeded', 1.0, 0, 7, 2.0)"))
        conn.execute(text("INSERT INTO history (run_id, step, loss, attempt) VALUES ('old', 7, 1.5, 0)"))
    engine.dispose()


def test_a_registry_made_before_migrations_is_stamped_and_upgraded_with_its_data(tmp_path: Path) -> None:
    for history_times in (True, False):
        url = sqlite_url(str(tmp_path / str(history_times)))
        (tmp_path / str(history_times)).mkdir()
        _made_by_todays_code_before_migrations(url, history_times=history_times)
        registry = Registry(url)
        assert [r["id"] for r in registry.run_rows()] == ["old"]
        assert [(h["step"], h["loss"]) for h in registry.history("old", after=-1, limit=10)] == [(7, 1.5)]
        registry.close()
        assert _diff(url) == [], history_times
        engine = create_engine(url)
        with engine.connect() as conn:
            assert revision(conn) == HEAD
            assert {"started_at", "ended_at"} <= {c["name"] for c in inspect(conn).get_columns("history")}
        engine.dispose()


def test_opening_an_upgraded_registry_again_changes_nothing(tmp_path: Path) -> None:
    url = sqlite_url(str(tmp_path))
    Registry(url).close()
    Registry(url).close()
    assert _diff(url) == []


def test_one_service_leads_a_registry_and_a_second_is_refused_until_the_first_is_gone(tmp_path: Path) -> None:
    from controller.errors import RegistryBusy
    import pytest

    url = sqlite_url(str(tmp_path))
    first, second = Registry(url), Registry(url)
    first.lead()
    with pytest.raises(RegistryBusy, match="another goodput serve drives the runs of this registry"):
        second.lead(wait_s=0.3)
    first.close()  # a leader that stops (or dies: the system drops its lock) lets the next one lead
    second.lead(wait_s=0.3)
    second.close()


def test_a_killed_leader_s_lock_goes_with_it(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    url = sqlite_url(str(tmp_path))
    Registry(url).close()
    code = ("import sys, time; sys.path.insert(0, '.'); from controller.service.registry import Registry; "
            f"r = Registry({url!r}); r.lead(); print('leading', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leading"
        from controller.errors import RegistryBusy

        with pytest.raises(RegistryBusy):
            Registry(url).lead(wait_s=0.3)
        proc.kill()  # our own child, by its PID
        proc.wait()
        t0 = time.monotonic()
        Registry(url).lead(wait_s=5)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_leader_sees_a_standby_only_while_one_offers_itself(tmp_path: Path) -> None:
    """A standby that reaches the cluster says so (a shared lock beside the database, PostgreSQL's
    shared advisory lock in test_postgres.py); the leader reads it at each still_leads, and a cut-off
    leader yields sooner to one (controller/service/main.py, YIELD_AFTER_S)."""
    url = sqlite_url(str(tmp_path))
    leader, standby, other = Registry(url), Registry(url), Registry(url)
    leader.lead()
    assert leader.still_leads() and not leader.standby_waiting
    standby.offer_standby(True)
    other.offer_standby(True)  # (shared: two standbys may wait)
    assert leader.still_leads() and leader.standby_waiting
    standby.offer_standby(False)
    assert leader.still_leads() and leader.standby_waiting, "one still stands by"
    other.close()  # (a standby that ends withdraws: its lock goes with it)
    assert leader.still_leads() and not leader.standby_waiting
    for r in (leader, standby):
        r.close()


def test_a_question_that_hangs_is_an_answer_no_and_is_not_asked_twice() -> None:
    import threading

    from controller.service.main import Asked

    release, asked = threading.Event(), []

    def question() -> bool:
        asked.append(1)
        release.wait(10)
        return True

    ask = Asked(question)
    assert ask(timeout_s=0.1) is False and ask(timeout_s=0.1) is False
    assert len(asked) == 1, "the question still in flight was not asked again"
    release.set()
    assert ask(timeout_s=5) is True, "its answer counts when it comes"
    assert ask(timeout_s=5) is True and len(asked) == 2
