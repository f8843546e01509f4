"""The registry's schema, as Alembic migrations (versions/): a registry is brought to the newest schema
when a service opens it, whatever goodput made it.

Alembic because it is the maintained tool for SQLAlchemy schemas: ordered, recorded revisions that run
alike on SQLite and PostgreSQL, instead of ALTERs in application code. A registry made before the
migrations existed (no alembic_version table) is stamped with the revision its tables match, then
upgraded.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import MetaData, Table, inspect
from sqlalchemy.engine import Connection

HEAD = "0004"
LEGACY_TABLES = ("runs", "attempts", "events", "history", "checkpoints", "nodes")
"""The tables goodput made before the migrations (with `create_all`): a registry that has some of them
but no alembic_version gets the missing ones as they were then, and is stamped."""
ADDED_SINCE = {("runs", "team")}
"""Columns of those tables that later migrations add (not made with them, or the migration would fail)."""


def upgrade(conn: Connection, metadata: MetaData) -> None:
    """Bring the registry behind `conn` to the newest schema (inside the caller's transaction).
    `metadata`: the tables in use, which a registry from before the migrations got from `create_all`."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    config.attributes["connection"] = conn
    tables = set(inspect(conn).get_table_names())
    if "alembic_version" not in tables and tables & set(metadata.tables):  # made before the migrations
        # what goodput did then on every start: only missing tables are made (the tables of that time, and
        # the runs table without the columns the migrations add)
        then = MetaData()
        for name in LEGACY_TABLES:
            if name not in tables:
                table = metadata.tables[name]
                if any(t == name for t, _ in ADDED_SINCE):  # (runs: its constraints are its columns')
                    Table(name, then, *[c._copy() for c in table.columns if (name, c.name) not in ADDED_SINCE])
                else:
                    table.to_metadata(then)
        then.create_all(conn)
        columns = {c["name"] for c in inspect(conn).get_columns("history")}
        command.stamp(config, "0002" if "started_at" in columns else "0001")
    command.upgrade(config, "head")


def revision(conn: Connection) -> str | None:
    """The registry's schema revision (None: no migration has run on it)."""
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()
