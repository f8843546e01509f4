"""The run registry's database: every table and every query of the service, through SQLAlchemy 2 Core.

SQLite under the service's state dir by default (one file, WAL, so the API reads while a run's driver
writes); any SQLAlchemy URL is accepted (`postgresql+psycopg://...`). The schema is brought to the newest revision on start
(Alembic migrations in controller/service/migrations; `metadata` below is what they build).
What is stored is what a restarted service needs to carry on and what the API shows:
runs (spec, state, the last Run object with its drill reports), attempts, the event timeline, per-step history, the
checkpoint index, and nodes the service took out of use.

SQLAlchemy because it is the maintained way to speak both SQLite and PostgreSQL from one set of
table definitions, with pooled connections and transactions that behave alike on both.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from sqlalchemy import create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool

from controller.events import EventKind
from controller.service.migrations import upgrade
from controller.service.tables import attempts, checkpoints, events, history, metadata, nodes, runs

__all__ = ["Registry", "Saved", "metadata", "safe_url", "sqlite_url"]


def safe_url(url: str) -> str:
    """A URL with its password hidden (it goes into messages)."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def sqlite_url(state_dir: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(state_dir), 'registry.db')}"


@dataclass
class Saved:
    """How much of one run is already in the database (so a save writes only what is new)."""

    events: int = 0
    history: list[tuple[int, int]] | None = None


class Registry:
    def __init__(self, url: str, *, migrate: bool = True) -> None:
        """`migrate=False`: the schema is left as it is until `migrate()` (goodput serve migrates only
        once it leads: two services starting together on an empty database would both create the
        tables, and a standby of a newer version would change the schema under a live leader)."""
        self.url = url
        sqlite = url.startswith("sqlite")
        memory = url in ("sqlite://", "sqlite:///:memory:")
        self.engine: Engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {},
            poolclass=StaticPool if memory else None,  # one connection: an in-memory database is per connection
            json_serializer=lambda obj: json.dumps(obj, default=str))
        if sqlite and not memory:
            @event.listens_for(self.engine, "connect")
            def _pragmas(conn: Any, _: Any) -> None:
                cursor = conn.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.close()
        self._lock = threading.RLock() if memory else contextlib.nullcontext()
        """An in-memory database is one connection: its users take turns (a file has SQLite's own locking)."""
        self.lost_lead: str | None = None
        """Why this process no longer leads (its lock's session ended): from then on it writes nothing."""
        self.standby_waiting = False
        """Whether another service stood by (`offer_standby`) at the leader's last `still_leads`."""
        self._standby: Any = None
        """While this process offers itself as a standby: the session (or file) holding the mark."""
        self._lead_check: threading.Thread | None = None
        """The thread of the last `still_leads` question (it may still wait on a server cut off)."""
        if migrate:
            self.migrate()

    def migrate(self) -> None:
        """Bring the schema to the newest revision (controller/service/migrations)."""
        with self._begin() as conn:
            upgrade(conn, metadata)

    LEAD_KEY = 0x676F6F64  # "good": the PostgreSQL advisory lock a leading service holds
    STANDBY_KEY = LEAD_KEY + 1
    """The advisory lock every standby that could take over now holds shared (`offer_standby`)."""

    def lead(self, *, wait_s: float = 10.0) -> bool:
        """Become the one service that drives this registry's runs, for as long as this process lives
        (a PostgreSQL session advisory lock, or a lock on a file beside the SQLite database; the system
        drops either when the process dies). Waits `wait_s` for a leader that is going away (a killed
        one's lock goes with its connection), then RegistryBusy says who holds it and what to do.
        `wait_s=0`: one try, and whether it leads now (no error)."""
        import time

        from controller.errors import RegistryBusy

        if self.url in ("sqlite://", "sqlite:///:memory:") or getattr(self, "_leadership", None) is not None:
            return True  # private to this process, or led already
        if wait_s == 0:
            return self._try_lead()
        deadline = time.monotonic() + wait_s
        while not self._try_lead():
            if time.monotonic() > deadline:
                raise RegistryBusy(
                    f"another goodput serve drives the runs of this registry ({safe_url(self.url)}): one service "
                    "per registry, or two would launch the same runs. Stop that one first, or give this one "
                    "its own --state-dir / --db (or start it with --standby to take over when that one is gone)")
            time.sleep(0.2)
        return True

    def still_leads(self, *, timeout_s: float = 3.0) -> bool:
        """Whether this process still holds the lock it took with `lead()`, asked of the server on the
        lock's own session (PostgreSQL: a restart, a failover or a proxy's idle kill ends the session
        and the lock with it, and a standby may take it). No answer within `timeout_s` counts as lost.
        Once lost, `lost_lead` says why and every later write raises NotLeading."""
        leadership = getattr(self, "_leadership", None)
        if self.lost_lead is not None:
            return False
        if leadership is None or self.engine.dialect.name == "sqlite":
            self.standby_waiting = leadership is not None and self._file_standby_waits()
            return True  # a file lock lives as long as this process: it cannot be taken from it
        answer: list[object] = []

        def ask() -> None:
            try:
                held, standbys = leadership.execute(text(
                    "SELECT count(*) FILTER (WHERE pid = pg_backend_pid() AND key = :lead), "
                    "count(*) FILTER (WHERE pid <> pg_backend_pid() AND key = :standby) FROM ("
                    "SELECT pid, (classid::bigint << 32) | objid::bigint AS key FROM pg_locks "
                    "WHERE locktype = 'advisory' AND granted AND objsubid = 1) AS advisory"),
                    {"lead": self.LEAD_KEY, "standby": self.STANDBY_KEY}).one()
                leadership.rollback()
                self.standby_waiting = bool(standbys)
                answer.append(bool(held) or "the server no longer shows this session holding the lock")
            except Exception as e:  # noqa: BLE001 - a dropped session: the lock went with it
                answer.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

        asking = threading.Thread(target=ask, daemon=True, name="goodput-lead-check")
        self._lead_check = asking
        asking.start()
        asking.join(timeout_s)
        why = answer[0] if answer else f"the lock's session did not answer in {timeout_s:g} s"
        if why is True:
            return True
        self.lost_lead = str(why)
        return False

    def offer_standby(self, ready: bool) -> None:
        """Say (`ready`) or unsay that this process stands by, able to take over now: it reaches the
        cluster. A leader cut off from its cluster yields sooner when one does (`standby_waiting`).
        The mark is a shared PostgreSQL advisory lock on a session of its own (or a shared lock on a
        file beside the SQLite database): it goes with this process, as the leader's lock does."""
        if ready == (self._standby is not None) or self.url in ("sqlite://", "sqlite:///:memory:"):
            return
        if not ready:
            standby, self._standby = self._standby, None
            if hasattr(standby, "invalidate"):
                try:  # (at once: a closed session's locks go only when its server process has ended)
                    standby.execute(text("SELECT pg_advisory_unlock_shared(:key)"), {"key": self.STANDBY_KEY})
                    standby.commit()
                except Exception:  # noqa: BLE001 - a session already gone took the mark with it
                    pass
                standby.invalidate()  # its session ends too (not back to the pool)
            standby.close()
        elif self.engine.dialect.name == "sqlite":
            import fcntl

            handle = open(self._standby_file(), "a")  # noqa: SIM115 - held open while it stands by
            fcntl.flock(handle, fcntl.LOCK_SH)
            self._standby = handle
        else:
            conn = self.engine.connect()
            conn.execute(text("SELECT pg_advisory_lock_shared(:key)"), {"key": self.STANDBY_KEY})
            conn.commit()
            self._standby = conn

    def _standby_file(self) -> str:
        path = self.engine.url.database
        assert path is not None
        return f"{path}.standby"

    def _file_standby_waits(self) -> bool:
        import fcntl

        with open(self._standby_file(), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # a standby holds it shared
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    def _try_lead(self) -> bool:
        if self.engine.dialect.name == "sqlite":
            import fcntl

            path = self.engine.url.database
            assert path is not None
            handle = open(f"{path}.lead", "a")  # noqa: SIM115 - held open while this process leads
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                return False
            self._leadership: Any = handle
            return True
        conn = self.engine.connect()  # its own session, held open: the lock lives as long as it does
        if conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.LEAD_KEY}).scalar():
            # The server drops this session (and the lock, for a standby to take) ~5 s after this
            # host stops answering, not after the kernel's default two hours of TCP silence (idle
            # session: keepalives) or ~15 minutes of retransmissions (an answer left unacknowledged).
            for setting, value in (("tcp_keepalives_idle", 2), ("tcp_keepalives_interval", 1),
                                   ("tcp_keepalives_count", 3), ("tcp_user_timeout", 5000)):
                conn.execute(text(f"SET {setting} = {value}"))
            conn.commit()
            self._leadership = conn
            return True
        conn.close()
        return False

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Connection]:
        if self.lost_lead is not None:
            from controller.errors import NotLeading

            raise NotLeading(f"this service lost the registry's lock ({self.lost_lead}): it writes nothing more")
        with self._lock, self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        with self._lock, self.engine.connect() as conn:
            yield conn

    def transaction(self) -> contextlib.AbstractContextManager[Connection]:
        """A write transaction (refused once this service lost the lead), for the service's other tables
        (controller/service/accounts.py)."""
        return self._begin()

    def reading(self) -> contextlib.AbstractContextManager[Connection]:
        """A connection to read with."""
        return self._connect()

    def close(self) -> None:
        self.offer_standby(False)
        leadership = getattr(self, "_leadership", None)
        if leadership is not None and self._lead_check is not None and self._lead_check.is_alive():
            # A lead check still waits on the lock's session (its server cut off). psycopg's close
            # frees the session under a query in flight in another thread (a leader cut off from its
            # database died of SIGSEGV there): it is left to that thread, and ends with this process.
            self._leadership = None
        elif leadership is not None:
            if self.lost_lead is not None and hasattr(leadership, "invalidate"):
                leadership.invalidate()  # (not back to the pool: its reset would wait on a server that is gone)
            leadership.close()  # the lock goes with it
            self._leadership = None
        self.engine.dispose()

    # -- runs -------------------------------------------------------------------------------------
    def add_run(self, *, run_id: str, name: str, spec: dict, state: str, created_at: float,
                team: str = "default") -> int:
        """A new run of `team`; its submission number (runs start in this order)."""
        with self._begin() as conn:
            seq = (conn.execute(select(func.max(runs.c.seq))).scalar() or 0) + 1
            conn.execute(insert(runs).values(id=run_id, seq=seq, name=name, spec=spec, state=state, team=team,
                                             created_at=created_at, attempt=0, step=0, updated_at=created_at))
        return int(seq)

    def has_run(self, run_id: str) -> bool:
        with self._connect() as conn:
            return conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first() is not None

    def run_rows(self) -> list[dict[str, Any]]:
        """Every run, in submission order."""
        with self._connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(runs).order_by(runs.c.seq))]

    def set_spec(self, run_id: str, spec: dict) -> None:
        with self._begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(spec=spec))

    def save(self, run_id: str, view: dict[str, Any], new_events: list[dict[str, Any]],
             hist: list[dict[str, Any]], saved: Saved, now: float) -> None:
        """Write what changed in one transaction: the Run object, the events not saved yet (and the
        attempts and checkpoint index they imply), the per-step history from where it last diverged
        (a rollback redoes steps). Costs what changed, not what the run has done (drill reports are in the
        Run object; a restarted service rebuilds them from the timeline)."""
        old_hist = saved.history if saved.history is not None else []
        same = min(len(old_hist), len(hist))
        while same > 0 and old_hist[same - 1] != (int(hist[same - 1]["step"]), int(hist[same - 1]["attempt"])):
            same -= 1
        with self._begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(
                state=view["state"], finished_at=view.get("finished_at"), attempt=view.get("attempt", 0),
                step=view.get("step", 0), loss=view.get("loss"), error=view.get("error"), view=view,
                updated_at=now))
            if new_events:
                conn.execute(insert(events), [
                    {"run_id": run_id, "seq": saved.events + i, "time": e["time"], "attempt": e["attempt"],
                     "kind": e["kind"], "detail": e["detail"]} for i, e in enumerate(new_events)])
                for e in new_events:
                    self._index(conn, run_id, e)
            if same < len(old_hist) or same < len(hist):
                if same < len(old_hist):
                    first_changed = old_hist[same][0]
                    conn.execute(delete(history).where(history.c.run_id == run_id, history.c.step >= first_changed))
                rows = [{"run_id": run_id, "step": h["step"], "loss": h["loss"], "attempt": h["attempt"],
                         "started_at": h.get("start"), "ended_at": h.get("end")} for h in hist[same:]]
                if rows:
                    conn.execute(delete(history).where(history.c.run_id == run_id,
                                                       history.c.step >= rows[0]["step"]))
                    conn.execute(insert(history), rows)
        saved.events += len(new_events)
        del old_hist[same:]
        old_hist.extend((int(h["step"]), int(h["attempt"])) for h in hist[same:])
        saved.history = old_hist

    def _index(self, conn: Any, run_id: str, e: dict[str, Any]) -> None:
        """Attempts and the checkpoint index, from the events that make them."""
        kind, d, t = e["kind"], e["detail"], e["time"]
        if kind == EventKind.ATTEMPT_STARTED:
            conn.execute(delete(attempts).where(attempts.c.run_id == run_id, attempts.c.attempt == e["attempt"]))
            conn.execute(insert(attempts).values(run_id=run_id, attempt=e["attempt"], started_at=t, mesh=d.get("mesh"),
                                                 placement=d.get("placement"), start_step=d.get("start_step") or 0,
                                                 resume_step=d.get("resume_step")))
        elif kind in (EventKind.FAILURE_DETECTED, EventKind.SUCCEEDED, EventKind.FAILED, EventKind.CANCELLED, EventKind.SERVICE_STOPPED):
            ended_by = d.get("cause", kind) if kind == EventKind.FAILURE_DETECTED else kind
            conn.execute(update(attempts).where(attempts.c.run_id == run_id, attempts.c.attempt == e["attempt"],
                                                attempts.c.ended_at.is_(None)).values(ended_at=t, ended_by=ended_by))
        elif kind == EventKind.CHECKPOINT_COMMITTED and "step" in d:
            conn.execute(delete(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.step == d["step"]))
            conn.execute(insert(checkpoints).values(run_id=run_id, step=d["step"], attempt=e["attempt"], committed_at=t,
                                                    uri=d.get("uri"), bytes=d.get("bytes"), seconds=d.get("seconds"),
                                                    state="committed"))
            for old in d.get("removed") or []:
                conn.execute(update(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.step == old)
                             .values(state="retired"))
        elif kind == EventKind.CHECKPOINT_DISCARDED and "step" in d:
            conn.execute(update(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.step == d["step"])
                         .values(state="discarded"))

    # -- reads --------------------------------------------------------------------------------------
    def events(self, run_id: str, *, after: int = -1, limit: int = 1000) -> list[dict[str, Any]]:
        """Events with seq > after, oldest first, at most `limit`."""
        with self._connect() as conn:
            rows = conn.execute(select(events).where(events.c.run_id == run_id, events.c.seq > after)
                                .order_by(events.c.seq).limit(limit))
            return [{"seq": r.seq, "time": r.time, "run_id": r.run_id, "attempt": r.attempt, "kind": r.kind,
                     "detail": r.detail} for r in rows]

    def all_events(self, run_id: str) -> list[dict[str, Any]]:
        return self.events(run_id, limit=10**9)

    def history(self, run_id: str, *, after: int = -1, limit: int = 10**9) -> list[dict[str, Any]]:
        """Kept steps in order: {step, loss, attempt, start, end} (start/end: Unix seconds, when known)."""
        with self._connect() as conn:
            rows = conn.execute(select(history).where(history.c.run_id == run_id, history.c.step > after)
                                .order_by(history.c.step).limit(limit))
            return [{"step": r.step, "loss": r.loss, "attempt": r.attempt, "start": r.started_at, "end": r.ended_at}
                    for r in rows]

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        with self._connect() as conn:
            rows = conn.execute(select(attempts).where(attempts.c.run_id == run_id).order_by(attempts.c.attempt))
            return [{k: v for k, v in r._mapping.items() if k != "run_id"} for r in rows]

    def checkpoints(self, run_id: str, *, state: str | None = "committed") -> list[dict[str, Any]]:
        with self._connect() as conn:
            q = select(checkpoints).where(checkpoints.c.run_id == run_id)
            if state is not None:
                q = q.where(checkpoints.c.state == state)
            return [{k: v for k, v in r._mapping.items() if k != "run_id"}
                    for r in conn.execute(q.order_by(checkpoints.c.step))]

    def index_checkpoint(self, run_id: str, *, step: int, attempt: int, committed_at: float, uri: str | None,
                         size: int | None, state: str = "committed") -> None:
        with self._begin() as conn:
            conn.execute(delete(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.step == step))
            conn.execute(insert(checkpoints).values(run_id=run_id, step=step, attempt=attempt, committed_at=committed_at,
                                                    uri=uri, bytes=size, state=state))

    def set_checkpoint_state(self, run_id: str, step: int, state: str) -> None:
        with self._begin() as conn:
            conn.execute(update(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.step == step)
                         .values(state=state))

    def reconcile_checkpoints(self, run_id: str, store: Any) -> None:
        """The index follows the events, and the store is the truth: a commit whose event died with its
        node is added, a step no longer in the store is marked retired. A store that does not answer
        leaves the index as it stands."""
        from checkpointing.manifest import index_changes, step_prefix
        from checkpointing.store import StoreError

        try:
            missing, gone = index_changes(store, run_id, {r["step"] for r in self.checkpoints(run_id)})
        except StoreError:
            return
        for m in missing:
            self.index_checkpoint(run_id, step=m.step, attempt=m.attempt, committed_at=m.created_at,
                                  uri=f"{store.uri}/{step_prefix(run_id, m.step)}", size=m.total_bytes())
        for step in gone:
            self.set_checkpoint_state(run_id, step, "retired")

    # -- nodes the service took out of use -----------------------------------------------------------
    def set_node(self, name: str, *, state: str, reason: str, run_id: str | None, time: float) -> None:
        with self._begin() as conn:
            conn.execute(delete(nodes).where(nodes.c.name == name))
            conn.execute(insert(nodes).values(name=name, state=state, reason=reason, run_id=run_id, time=time))

    def node_rows(self) -> list[dict[str, Any]]:
        with self._connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(nodes).order_by(nodes.c.name))]
