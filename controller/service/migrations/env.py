"""Alembic's entry: migrations run on the connection the registry hands over (migrations.upgrade)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
