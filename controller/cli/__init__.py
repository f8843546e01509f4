"""The `goodput` command line (its entry point: controller/cli/main.py `main`), its terminal views and
its REST client."""
