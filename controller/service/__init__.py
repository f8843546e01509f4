"""The long-lived service: the REST app, the run registry and its database, auth, and the scheduler
that shares one Ray cluster among submitted runs."""
