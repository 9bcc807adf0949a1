"""An incident-history agent served over A2A 1.0: a remote specialist for convene workers.

An example A2A agent written with the official Python SDK (`pip install
"a2a-sdk[http-server]"==1.3.0 uvicorn`). A convene worker profile with `provider: a2a`
and `url: http://127.0.0.1:<port>` hands it a delegation: the goal, acceptance criteria
and the profile's instructions as a text part, the delegation's structured inputs
(ids, scope, time window, input refs, deadline) as a data part. The agent looks the
incident up in its (built-in) history and answers with a completed task holding two
artifacts:

- `assessment`: a text artifact, the agent's answer in prose;
- `findings`: a data artifact with `claims` (topic, value, statement, confidence: the
  claims a convene worker turns into its result, each citing the evidence it stored
  for this artifact) and `received`, what the agent was asked and by whom: the
  delegation id, the W3C `traceparent` the request carried (so a trace viewer links
  the agent's work to the run) and whether the request carried a credential (never
  the credential itself).

It serves the JSON-RPC binding at `/` and its agent card at
`/.well-known/agent-card.json`.

Flags: `--host` (default 127.0.0.1) and `--port` (0 picks a free one); `--token-env
NAME` makes every JSON-RPC call present `Authorization: Bearer <$NAME>` (the card stays
public); `--outcome failed|rejected` answers every task in that state instead, for
drills. The agent prints `listening on <url>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import os
import socket
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from a2a.helpers import (
    get_data_parts,
    new_data_part,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Role,
)

# The incidents the agent remembers, by the service they hit.
HISTORY: dict[str, dict[str, Any]] = {
    "payment-api": {
        "incident": "INC-20260611-0140",
        "cause": "connection_pool_exhaustion",
        "summary": (
            "On 2026-06-11 at 01:40 UTC payment confirmations timed out for 22 minutes: "
            "a risk-rule change tripled the calls per payment and exhausted the "
            "payments-primary connection pool. Rolling the rule back restored the success "
            "rate within 4 minutes."
        ),
    },
    "risk-gateway": {
        "incident": "INC-20260502-1115",
        "cause": "risk_rule_change",
        "summary": (
            "On 2026-05-02 a risk rule deployed without a baseline comparison raised the "
            "gateway's P95 latency from 180 ms to 900 ms until it was rolled back."
        ),
    },
}


def service_of(inputs: dict[str, Any]) -> str:
    """The service a delegation is about: its first `service/<name>` resource."""
    for resource in inputs.get("scope", {}).get("resources", []):
        if isinstance(resource, str) and resource.startswith("service/"):
            return resource.removeprefix("service/")
    return "payment-api"


class IncidentHistoryAgent(AgentExecutor):
    """Answers a delegation with the most similar past incident."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        task = context.current_task or new_task_from_user_message(message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()

        if self.outcome == "failed":
            await updater.failed(self._say(task, "the incident history is unavailable"))
            return
        if self.outcome == "rejected":
            await updater.reject(self._say(task, "this agent does not take delegations now"))
            return

        data = get_data_parts(message.parts)
        inputs = data[0] if data and isinstance(data[0], dict) else {}
        service = service_of(inputs)
        known = HISTORY.get(service)
        headers = context.call_context.state.get("headers", {})
        received = {
            "delegation_id": inputs.get("delegation_id", ""),
            "goal": inputs.get("goal", ""),
            "traceparent": headers.get("traceparent", ""),
            "authorized": "authorization" in headers,
        }
        if known is None:
            text = f"No incident on {service} in the history resembles this one."
            claims: list[dict[str, Any]] = []
        else:
            text = known["summary"]
            claims = [
                {
                    "claim_id": "prior-incident",
                    "topic": "prior_incident",
                    "value": known["incident"],
                    "statement": f"{known['incident']} on {service} matches: {known['summary']}",
                    "confidence": 0.7,
                },
                {
                    "claim_id": "prior-cause",
                    "topic": "prior_cause",
                    "value": known["cause"],
                    "statement": f"The cause of {known['incident']} was {known['cause']}.",
                    "confidence": 0.6,
                },
            ]
        await updater.add_artifact([new_text_part(text, media_type="text/plain")], name="assessment")
        await updater.add_artifact(
            [new_data_part({"claims": claims, "received": received}, media_type="application/json")],
            name="findings",
        )
        await updater.complete(self._say(task, f"Looked up the incident history of {service}."))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task
        if task is not None:
            await TaskUpdater(event_queue, task.id, task.context_id).cancel()

    @staticmethod
    def _say(task: Any, text: str) -> Any:
        return new_text_message(text, context_id=task.context_id, task_id=task.id, role=Role.ROLE_AGENT)


class RequireBearer(BaseHTTPMiddleware):
    """Refuses JSON-RPC calls without the expected bearer credential (the card is public)."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.expected = f"Bearer {token}".encode()

    async def dispatch(self, request: Request, call_next: Any) -> Any:
        if request.method == "POST":
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                return JSONResponse({"error": "a bearer credential is required"}, status_code=401)
        return await call_next(request)


def agent_card(url: str) -> AgentCard:
    return AgentCard(
        name="Incident history",
        description="Finds the past incident most like the one a delegation describes.",
        version="1.0.0",
        supported_interfaces=[AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=False),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[
            AgentSkill(
                id="incident-history",
                name="Incident history",
                description="The most similar past incident, its cause and how it ended.",
                tags=["incident", "history"],
            )
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9999, help="port; 0 picks a free one (default 9999)")
    parser.add_argument("--token-env", help="require `Authorization: Bearer <$NAME>` on every call")
    parser.add_argument(
        "--outcome",
        choices=["completed", "failed", "rejected"],
        default="completed",
        help="the state every task ends in (default completed)",
    )
    args = parser.parse_args()

    token = None
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            sys.exit(f"--token-env {args.token_env}: the variable is unset or empty")

    # Bound before the card is written, so the card names the port actually used.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    card = agent_card(url)
    handler = DefaultRequestHandler(
        agent_executor=IncidentHistoryAgent(args.outcome),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )

    @contextlib.asynccontextmanager
    async def announce(_app: Starlette) -> Any:
        print(f"listening on {url}", flush=True)
        yield

    app = Starlette(
        routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")],
        lifespan=announce,
    )
    if token is not None:
        app.add_middleware(RequireBearer, token=token)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
