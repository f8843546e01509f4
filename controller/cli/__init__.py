"""The `goodput` command line, its terminal views and its REST client."""

from controller.cli.main import main

__all__ = ["main"]
