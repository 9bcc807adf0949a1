"""A runbook lookup served over MCP: the on-call runbooks of the payment-incident example.

An example MCP server for convene workers, written with the official Python SDK
(`pip install mcp==2.3.0`). It serves stdio by default, which is how a worker starts it
(`command` + `args` in the worker's MCP configuration), and streamable HTTP with
`--http` (a worker then names its `url`).

Tools:

- `lookup_runbook(service)`: the runbook of one service (symptoms, steps, escalation),
  as structured content. An unknown service is a tool error (`isError: true`).
- `search_runbooks(text)`: the runbooks whose title, symptoms or steps mention `text`.
- `slow_lookup(service, seconds)`: `lookup_runbook` through a slow backend; it waits
  `seconds` first. For timeout and crash drills; `seconds` outside [0, 600] is refused
  with a JSON-RPC error (invalid params).
- `reload_runbooks()`: re-reads the runbooks. Runbooks with automation make the server
  offer one more tool, `execute_runbook_step`, and tell the client so with
  `notifications/tools/list_changed`.
- `delete_runbook(service)`: deletes a runbook. Destructive on purpose: the example
  policy does not declare it, so a convene worker never offers or calls it; neither is
  `execute_runbook_step`.

Flags: `--http` with `--host`/`--port` (port 0 picks a free one)/`--path`; `--state-dir
DIR` writes `server.pid`, the HTTP `url`, and a `<tool>.started` marker when
`slow_lookup` begins (for supervisors and tests). With `--http` the server prints
`listening on <url>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import sys
from typing import Any

from mcp import types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError

# The runbooks, by service. `automation` marks steps a runbook engine could run; the
# server offers them (as `execute_runbook_step`) only after `reload_runbooks`.
RUNBOOKS: dict[str, dict[str, Any]] = {
    "payment-api": {
        "service": "payment-api",
        "title": "payment-api: confirmations time out",
        "owner": "team-payments",
        "symptoms": [
            "payment_confirm calls time out (outcome=timeout)",
            "POOL_EXHAUSTED errors on pool payments-primary",
            "success rate below 98% for 5 minutes",
        ],
        "steps": [
            "Check whether POOL_EXHAUSTED began after a change upstream (risk-gateway, rule changes).",
            "Compare active connections with the pool maximum (50 on payments-primary).",
            "If an upstream change explains the load, roll it back before resizing the pool.",
            "Resize the pool (PAY-1290) only with the payments on-call's approval.",
        ],
        "escalation": "payments on-call, then the incident commander after 15 minutes",
        "related": ["risk-gateway", "rule/RC-4711"],
    },
    "risk-gateway": {
        "service": "risk-gateway",
        "title": "risk-gateway: checks slow down or block payments",
        "owner": "team-risk",
        "symptoms": [
            "risk_check latency above 1 s at p95",
            "a spike in review or block decisions after a rule change",
        ],
        "steps": [
            "List the risk-rule changes of the last hour (rule id, version, threshold).",
            "Compare the hit rate of a changed rule before and after its change.",
            "Roll a rule back to its previous version only with two approvers (R3).",
        ],
        "escalation": "risk on-call; rule rollbacks need two approvers",
        "related": ["payment-api", "rule/RC-4711"],
        "automation": ["rollback_rule"],
    },
    "rule-RC-4711": {
        "service": "rule-RC-4711",
        "title": "RC-4711 rapid-high-value-payment: threshold changes",
        "owner": "team-risk",
        "symptoms": [
            "hit rate of RC-4711 several times its baseline",
            "payment-api retries pile up behind risk reviews",
        ],
        "steps": [
            "Read the change record (RISK-884): previous version 2026.7.1, threshold 1500.00 EUR.",
            "Propose rule:rollback to 2026.7.1; two approvers execute it.",
        ],
        "escalation": "risk on-call",
        "related": ["risk-gateway", "payment-api"],
    },
}

SERVER = MCPServer(
    "runbooks",
    instructions="On-call runbooks of the payments platform, by service.",
    log_level="WARNING",
)
STATE_DIR: pathlib.Path | None = None


def _mark(name: str, text: str = "") -> None:
    """Writes `<state-dir>/<name>` when a state directory was given."""
    if STATE_DIR is not None:
        (STATE_DIR / name).write_text(text)


def _runbook(service: str) -> dict[str, Any]:
    runbook = RUNBOOKS.get(service)
    if runbook is None:
        known = ", ".join(sorted(RUNBOOKS))
        raise ToolError(f"no runbook for service {service!r}; known services: {known}")
    return {k: v for k, v in runbook.items() if k != "automation"}


@SERVER.tool()
def lookup_runbook(service: str) -> dict[str, Any]:
    """The runbook of one service: symptoms, steps and escalation."""
    return _runbook(service)


@SERVER.tool()
def search_runbooks(text: str) -> dict[str, Any]:
    """The runbooks whose title, symptoms or steps mention `text` (case-insensitive)."""
    needle = text.lower()
    matches = [
        {"service": r["service"], "title": r["title"]}
        for r in RUNBOOKS.values()
        if needle in r["title"].lower()
        or any(needle in line.lower() for line in r["symptoms"] + r["steps"])
    ]
    return {"text": text, "matches": matches}


@SERVER.tool()
async def slow_lookup(service: str, seconds: float = 30.0) -> dict[str, Any]:
    """`lookup_runbook` through a slow backend: waits `seconds` (0 to 600) first."""
    if not 0 <= seconds <= 600:
        # A protocol-level refusal (a JSON-RPC error), unlike the tool errors above.
        raise MCPError(types.INVALID_PARAMS, f"seconds must lie in [0, 600], not {seconds}")
    _mark("slow_lookup.started", str(os.getpid()))
    await asyncio.sleep(seconds)
    return _runbook(service)


@SERVER.tool()
def delete_runbook(service: str) -> str:
    """Deletes the runbook of a service. Destructive."""
    if RUNBOOKS.pop(service, None) is None:
        raise ToolError(f"no runbook for service {service!r}")
    return f"deleted the runbook of {service}"


def execute_runbook_step(service: str, step: str) -> str:
    """Runs an automated step of a runbook (e.g. rollback_rule). Changes production."""
    automation = RUNBOOKS.get(service, {}).get("automation", [])
    if step not in automation:
        raise ToolError(f"runbook {service!r} automates no step {step!r}")
    return f"ran {step} of {service}"


@SERVER.tool()
async def reload_runbooks(ctx: Context) -> dict[str, Any]:
    """Re-reads the runbooks; automated steps become the tool execute_runbook_step."""
    added = []
    if any(r.get("automation") for r in RUNBOOKS.values()):
        names = {t.name for t in await SERVER.list_tools()}
        if "execute_runbook_step" not in names:
            SERVER.add_tool(execute_runbook_step)
            added.append("execute_runbook_step")
    if added:
        # On the request's own stream, so a streamable-HTTP client gets it before the
        # answer, as a stdio client does.
        await ctx.session.send_notification(
            types.ToolListChangedNotification(), related_request_id=ctx.request_id
        )
    return {"runbooks": len(RUNBOOKS), "tools_added": added}


async def serve_http(host: str, port: int, path: str) -> None:
    """Serves streamable HTTP on (host, port), printing the URL once it listens."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A restarted server takes its port back at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    url = f"http://{host}:{sock.getsockname()[1]}{path}"
    app = SERVER.streamable_http_app(streamable_http_path=path, host=host)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    _mark("url", url)
    print(f"listening on {url}", flush=True)
    await server.serve(sockets=[sock])


def main() -> None:
    global STATE_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port; 0 picks a free one (default 8765)")
    parser.add_argument("--path", default="/mcp", help="HTTP path of the MCP endpoint (default /mcp)")
    parser.add_argument("--state-dir", type=pathlib.Path, help="write server.pid, url and call markers here")
    args = parser.parse_args()
    if args.state_dir is not None:
        STATE_DIR = args.state_dir
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _mark("server.pid", str(os.getpid()))
    if args.http:
        asyncio.run(serve_http(args.host, args.port, args.path))
    else:
        SERVER.run()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
