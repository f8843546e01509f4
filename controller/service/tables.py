"""The registry's tables (SQLAlchemy Core): what the Alembic migrations in controller/service/migrations
build, and what every query of the registry and of the service's accounts (controller/service/accounts.py)
reads and writes."""

from __future__ import annotations

from sqlalchemy import JSON, Column, Float, Integer, MetaData, String, Table, Text, UniqueConstraint

metadata = MetaData()

runs = Table(
    "runs", metadata,
    Column("id", String(128), primary_key=True),
    Column("seq", Integer, nullable=False, unique=True),
    Column("name", String(128), nullable=False),
    Column("spec", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("attempt", Integer, nullable=False, default=0),
    Column("step", Integer, nullable=False, default=0),
    Column("loss", Float),
    Column("error", JSON),
    Column("view", JSON),
    Column("updated_at", Float, nullable=False),
    Column("team", String(64), nullable=False, server_default="default"),
)

attempts = Table(
    "attempts", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("started_at", Float, nullable=False),
    Column("mesh", JSON),
    Column("placement", JSON),
    Column("start_step", Integer, nullable=False, default=0),
    Column("resume_step", Integer),
    Column("ended_at", Float),
    Column("ended_by", String(64)),
)

events = Table(
    "events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(128), nullable=False, index=True),
    Column("seq", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("detail", JSON, nullable=False),
    UniqueConstraint("run_id", "seq"),
)

history = Table(
    "history", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("loss", Float),
    Column("attempt", Integer, nullable=False),
    Column("started_at", Float),
    Column("ended_at", Float),
)

checkpoints = Table(
    "checkpoints", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("committed_at", Float, nullable=False),
    Column("uri", String(1024)),
    Column("bytes", Integer),
    Column("seconds", Float),
    Column("state", String(16), nullable=False, comment="committed, retired (by retention) or discarded (rollback)"),
)

nodes = Table(
    "nodes", metadata,
    Column("name", String(128), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("run_id", String(128)),
    Column("time", Float, nullable=False),
)

teams = Table(
    "teams", metadata,
    Column("name", String(64), primary_key=True),
    Column("gpu_quota", Integer, comment="GPUs its runs may hold at once; NULL: no limit"),
    Column("created_at", Float, nullable=False),
)

tokens = Table(
    "tokens", metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(128), nullable=False, comment="the person or automation it was made for"),
    Column("team", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("secret_hash", String(256), nullable=False, comment="scrypt of the token's secret; never the token"),
    Column("created_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("revoked_at", Float),
)

audit = Table(
    "audit", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False, index=True),
    Column("who", String(128), nullable=False),
    Column("team", String(64)),
    Column("role", String(16)),
    Column("via", String(16)),
    Column("method", String(8), nullable=False),
    Column("path", Text, nullable=False),
    Column("status", Integer, nullable=False),
    Column("detail", JSON),
)
