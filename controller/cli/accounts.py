"""Commands for a shared service's accounts, over its REST API: `goodput tokens` (an admin's: create,
list, revoke), `goodput teams` (list; an admin creates) and `goodput audit` (an operator's)."""

from __future__ import annotations

import argparse

from controller.cli.remote import api
from controller.cli.render import CliError, clock, emit_json, table


def cmd_tokens(opts: argparse.Namespace) -> int:
    with api() as client:
        if opts.action == "create":
            if not opts.name:
                raise CliError("give who the token is for: goodput tokens create NAME --team TEAM --role ROLE")
            made = client.call("POST", "/v1/tokens", {"name": opts.name, "team": opts.team, "role": opts.role})
            if opts.json:
                emit_json(made)
            else:
                print(f"token {made['id']} for {made['name']} ({made['role']}, team {made['team']}):")
                print(made["token"])
                print("It is shown this once (the service keeps only its hash): hand it over as GOODPUT_TOKEN.")
            return 0
        if opts.action == "revoke":
            if not opts.name:
                raise CliError("give the token's id: goodput tokens revoke ID (goodput tokens list shows them)")
            revoked = client.call("POST", f"/v1/tokens/{opts.name}/revoke")
            if opts.json:
                emit_json(revoked)
            else:
                print(f"token {revoked['id']} ({revoked['name']}) revoked; the runs it submitted go on")
            return 0
        listed = client.call("GET", "/v1/tokens")
    if opts.json:
        emit_json(listed)
        return 0
    table(["id", "name", "team", "role", "made", "by", "revoked"],
          [[t["id"], t["name"], t["team"], t["role"], clock(t["created_at"]), t["created_by"],
            clock(t["revoked_at"]) if t["revoked_at"] else "-"] for t in listed])
    return 0


def cmd_teams(opts: argparse.Namespace) -> int:
    with api() as client:
        if opts.action == "create":
            if not opts.name:
                raise CliError("give the team's name: goodput teams create NAME [--gpu-quota N]")
            made = client.call("POST", "/v1/teams", {"name": opts.name, "gpu_quota": opts.gpu_quota})
            if opts.json:
                emit_json(made)
            else:
                quota = "no GPU quota" if made["gpu_quota"] is None else f"a quota of {made['gpu_quota']} GPU(s)"
                print(f"team {made['name']}: made, with {quota}")
            return 0
        if opts.action == "quota":
            if not opts.name or opts.gpu_quota is None and not opts.no_quota:
                raise CliError("give the team and its quota: goodput teams quota NAME --gpu-quota N (or --no-quota)")
            row = client.call("POST", f"/v1/teams/{opts.name}/quota",
                              {"gpu_quota": None if opts.no_quota else opts.gpu_quota})
            if opts.json:
                emit_json(row)
            else:
                print(f"team {row['name']}: " + ("no GPU quota" if row["gpu_quota"] is None
                                                 else f"a quota of {row['gpu_quota']} GPU(s)") + " from now on")
            return 0
        listed = client.call("GET", "/v1/teams")
    if opts.json:
        emit_json(listed)
        return 0
    table(["team", "gpu quota", "gpus held", "queued", "longest wait", "preemptions"],
          [[t["name"], "-" if t["gpu_quota"] is None else t["gpu_quota"], t.get("gpus_held", 0), t.get("queued", 0),
            f"{t.get('longest_wait_s', 0.0):.0f} s" if t.get("queued") else "-", t.get("preemptions", 0)]
           for t in listed])
    return 0


def cmd_audit(opts: argparse.Namespace) -> int:
    with api() as client:
        rows = client.call("GET", "/v1/audit", params={"after": opts.after, "limit": opts.limit})
    if opts.json:
        emit_json(rows)
        return 0
    table(["id", "when", "who", "team", "role", "request", "answer"],
          [[r["id"], clock(r["time"]), r["who"], r["team"] or "-", r["role"] or "-", f"{r['method']} {r['path']}",
            r["status"]] for r in rows])
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    tokens = sub.add_parser("tokens", help="API tokens of a shared service (an admin's): create, list, revoke")
    tokens.add_argument("action", nargs="?", choices=["list", "create", "revoke"], default="list")
    tokens.add_argument("name", nargs="?", help="create: who it is for; revoke: the token's id")
    tokens.add_argument("--team", default="default", help="create: the team whose runs it submits and sees")
    tokens.add_argument("--role", default="submitter", choices=["viewer", "submitter", "operator", "admin"],
                        help="create: what it may do (default submitter)")
    tokens.add_argument("--json", action="store_true")
    tokens.set_defaults(func=cmd_tokens)
    teams = sub.add_parser("teams", help="the service's teams and their GPU quotas; an admin creates one or "
                                         "changes its quota")
    teams.add_argument("action", nargs="?", choices=["list", "create", "quota"], default="list")
    teams.add_argument("name", nargs="?", help="create, quota: the team's name")
    teams.add_argument("--gpu-quota", type=int, help="create, quota: GPUs its runs may hold at once (default: no limit)")
    teams.add_argument("--no-quota", action="store_true", help="quota: no limit from now on")
    teams.add_argument("--json", action="store_true")
    teams.set_defaults(func=cmd_teams)
    audit = sub.add_parser("audit", help="every mutating request to the service: who, what, when, the answer")
    audit.add_argument("--after", type=int, default=0, help="rows after this id")
    audit.add_argument("--limit", type=int, default=200)
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=cmd_audit)
