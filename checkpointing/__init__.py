"""Async sharded checkpoints, manifests and object stores. Imports nothing of the project."""
