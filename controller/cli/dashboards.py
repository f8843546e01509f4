"""`goodput dashboards push`: upload the generated Grafana dashboards (dashboards/grafana/*.json) into
a Grafana folder with grafana-client (the maintained Python client of Grafana's HTTP API)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FOLDER_UID = "goodput"
FOLDER_TITLE = "goodput"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "dashboards" / "grafana"
"""The checked-in dashboards of a source checkout (pip installs pass --dir)."""


class PushError(Exception):
    """One line that says what to fix."""


def load_dashboards(directory: Path) -> list[dict[str, Any]]:
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        raise PushError(f"no dashboards (*.json) in {directory}; give --dir the folder `python dashboards/build.py` "
                        "writes (dashboards/grafana in a goodput checkout)")
    out = []
    for path in files:
        try:
            board = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PushError(f"{path} is not JSON ({e}); regenerate it with `python dashboards/build.py`") from None
        if not isinstance(board, dict) or not board.get("uid") or not board.get("title"):
            raise PushError(f"{path} is not a dashboard (no uid or title)")
        out.append(board)
    return out


def push(url: str, token: str | None, directory: Path, *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Create the folder if missing, then create or overwrite each dashboard by uid. Returns one
    {uid, title, url, version} per dashboard, as Grafana answered."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException
    from requests.exceptions import RequestException

    boards = load_dashboards(directory)
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        try:
            api.folder.get_folder(FOLDER_UID)
        except GrafanaClientError as e:
            if e.status_code != 404:
                raise
            api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        pushed = []
        for board in boards:
            answer = api.dashboard.update_dashboard({"dashboard": {**board, "id": None}, "folderUid": FOLDER_UID,
                                                     "overwrite": True, "message": "goodput dashboards push"})
            pushed.append({"uid": board["uid"], "title": board["title"], "url": answer.get("url"),
                           "version": answer.get("version")})
        return pushed
    except GrafanaClientError as e:
        if e.status_code in (401, 403):
            raise PushError(f"Grafana at {url} refused the token ({e.status_code}); give --token a service-account "
                            "token with the Editor role (or GRAFANA_TOKEN)") from None
        raise PushError(f"Grafana at {url} answered {e.status_code}: {e.message}") from None
    except GrafanaException as e:
        raise PushError(f"Grafana at {url} failed ({e.status_code}): {e.message}") from None
    except RequestException as e:
        raise PushError(f"no Grafana answers at {url} ({type(e).__name__}); check --url") from None
