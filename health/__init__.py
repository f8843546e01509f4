"""Straggler, hang and silent-data-corruption probes and their verdicts. Imports nothing of the project."""
