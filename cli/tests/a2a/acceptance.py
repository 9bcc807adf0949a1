"""Acceptance scenarios of convene's A2A gateway, driven by the official A2A client.

Each subcommand is one scenario against a running gateway (`convene up` serves one):
it talks to the gateway only through the `a2a-sdk` 1.x client (card resolver, client
factory, the JSON-RPC or HTTP+JSON transport, the bearer auth interceptor), plus plain
httpx where the scenario is about HTTP itself (401/403 challenges, card caching). On
success it prints one JSON object summarising what it saw and exits 0; on failure it
prints `FAIL: <what was expected and what came>` on stderr and exits 1.

    python acceptance.py --url http://127.0.0.1:7480 \
        --credentials <data-dir>/credentials --binding rest send-poll

Scenarios: card, send-poll, blocking, unauthenticated, cancel-running, cancel-ended,
not-found, stream, tighten, traced (see each function's docstring). Credentials are the
principals' development credentials, `<credentials>/<principal>.secret`; they are sent
as `Authorization: Bearer` headers and never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from google.protobuf.json_format import MessageToDict

from a2a.client import (
    A2ACardResolver,
    AuthInterceptor,
    Client,
    ClientCallContext,
    ClientConfig,
    ClientFactory,
    CredentialService,
)
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.constants import PROTOCOL_VERSION_CURRENT, VERSION_HEADER, TransportProtocol
from a2a.utils.errors import (
    A2AError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
)

ONCALL = "oncall@acme"
ALICE = "alice@acme"
ANALYST = "analyst@globex"
# A service principal with no run roles at all.
NO_RUN_ROLES = "worker-pool"

SKILL = "payment-incident-triage"
JSONRPC_PATH = "/a2a/jsonrpc"
REST_PATH = "/a2a/rest"
BINDINGS = {"jsonrpc": TransportProtocol.JSONRPC, "rest": TransportProtocol.HTTP_JSON}

# How long a run of the payment incident may take to stop (its join decides by a 20 s
# deadline; a loaded machine is slower).
RUN_LIMIT = 120.0
# How long one HTTP call may take: a blocking SendMessage lasts until the run stops.
HTTP_TIMEOUT = RUN_LIMIT + 30.0
POLL = 0.2


class Failure(Exception):
    """A scenario's expectation that did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def state_name(state: int) -> str:
    """`TASK_STATE_INPUT_REQUIRED` → `INPUT_REQUIRED`."""
    return TaskState.Name(state).removeprefix("TASK_STATE_")


class PrincipalCredentials(CredentialService):
    """The development credential of one principal, for the card's bearer scheme."""

    def __init__(self, credential: str) -> None:
        self._credential = credential

    async def get_credentials(
        self, security_scheme_name: str, context: ClientCallContext | None
    ) -> str | None:
        return self._credential


class Gateway:
    """The gateway under test, as the official client sees it."""

    def __init__(
        self, url: str, credentials: Path, binding: str, release: Path | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.credentials = credentials
        self.binding = binding
        self._release = release
        self._card: AgentCard | None = None
        self._clients: list[Client] = []
        self._http: list[httpx.AsyncClient] = []

    def secret(self, principal: str) -> str:
        path = self.credentials / f"{principal}.secret"
        try:
            return path.read_text().strip()
        except OSError as e:
            raise Failure(
                f"no credential for {principal} at {path} ({e.strerror}); pass the "
                "credentials directory of the data directory `convene up` uses"
            ) from e

    def release(self) -> None:
        """Lets held delegations go: creates the release file of the workers' `hold`,
        when the gateway's mesh holds them (`--release`). Scenarios call it once they
        have seen what must be seen while the run is still going."""
        if self._release is not None:
            self._release.touch()

    def binding_url(self) -> str:
        return self.url + (JSONRPC_PATH if self.binding == "jsonrpc" else REST_PATH)

    def http(self, **kwargs: Any) -> httpx.AsyncClient:
        client = httpx.AsyncClient(timeout=HTTP_TIMEOUT, **kwargs)
        self._http.append(client)
        return client

    async def card(self) -> AgentCard:
        if self._card is None:
            self._card = await A2ACardResolver(self.http(), self.url).get_agent_card()
        return self._card

    async def client(self, principal: str, *, streaming: bool = False) -> Client:
        """A client of `principal` on the chosen binding; its bearer comes from the
        SDK's auth interceptor, following the card's security scheme."""
        config = ClientConfig(
            streaming=streaming,
            httpx_client=self.http(),
            supported_protocol_bindings=[BINDINGS[self.binding]],
        )
        client = ClientFactory(config).create(
            await self.card(),
            interceptors=[AuthInterceptor(PrincipalCredentials(self.secret(principal)))],
        )
        self._clients.append(client)
        return client

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        for http in self._http:
            if not http.is_closed:
                await http.aclose()


def message(text: str) -> Message:
    return Message(
        role=Role.ROLE_USER,
        message_id=str(uuid.uuid4()),
        parts=[Part(text=text)],
    )


def send_request(
    text: str, *, immediately: bool, metadata: dict[str, Any] | None = None
) -> SendMessageRequest:
    request = SendMessageRequest(
        message=message(text),
        configuration=SendMessageConfiguration(return_immediately=immediately),
    )
    request.metadata.update({"skill": SKILL, **(metadata or {})})
    return request


async def send(
    client: Client, request: SendMessageRequest, context: ClientCallContext | None = None
) -> Task:
    """SendMessage (the client is not streaming): the one Task it answers."""
    responses = [r async for r in client.send_message(request, context=context)]
    check(len(responses) == 1, f"SendMessage answered {len(responses)} responses")
    check(
        responses[0].HasField("task"),
        f"SendMessage answered no Task: {MessageToDict(responses[0])}",
    )
    return responses[0].task


async def start(gateway: Gateway, principal: str = ONCALL) -> Task:
    """A task started with returnImmediately: at once, before the run stops."""
    client = await gateway.client(principal)
    task = await send(
        client, send_request("Started over A2A by the acceptance tests.", immediately=True)
    )
    check(bool(task.id), "the task has no id")
    check(
        state_name(task.status.state) in ("SUBMITTED", "WORKING"),
        f"returnImmediately answered a task in {state_name(task.status.state)}, not "
        "SUBMITTED or WORKING: the run cannot have stopped yet",
    )
    return task


async def poll(
    client: Client,
    task_id: str,
    until: Callable[[Task], bool],
    what: str,
    release: Callable[[], None],
) -> tuple[Task, list[str]]:
    """GetTask until `until` holds; the task and the states seen, in order. `release`
    is called after each GetTask (the first lets held delegations go)."""
    deadline = time.monotonic() + RUN_LIMIT
    seen: list[str] = []
    while True:
        task = await client.get_task(GetTaskRequest(id=task_id))
        state = state_name(task.status.state)
        if not seen or seen[-1] != state:
            seen.append(state)
        release()
        if until(task):
            return task, seen
        check(
            time.monotonic() < deadline,
            f"waited {RUN_LIMIT:.0f}s for {what}; states seen: {seen}",
        )
        await asyncio.sleep(POLL)


def meta(task: Task) -> dict[str, Any]:
    return MessageToDict(task.metadata) if task.HasField("metadata") else {}


def artifacts_of(task: Task) -> dict[str, Any]:
    """What the task's result artifacts say, checked: `assessment` (a text part) and
    `decision` (a data part with outcome, decision, claims and actions)."""
    ids = [a.artifact_id for a in task.artifacts]
    check(ids == ["assessment", "decision"], f"artifacts {ids}, not [assessment, decision]")
    assessment, decision = task.artifacts
    check(
        len(assessment.parts) == 1 and assessment.parts[0].HasField("text"),
        "the assessment artifact is not one text part",
    )
    check(
        len(decision.parts) == 1 and decision.parts[0].HasField("data"),
        "the decision artifact is not one data part",
    )
    data = MessageToDict(decision.parts[0].data)
    check(isinstance(data, dict), f"the decision data is not an object: {data!r}")
    for key in ("outcome", "decision", "claims", "actions"):
        check(key in data, f"the decision data has no `{key}`: {sorted(data)}")
    conflicts = [c.get("topic") for c in data["decision"].get("conflicts", [])]
    actions = [
        {"action": a.get("action"), "risk": a.get("riskLevel"), "state": a.get("state")}
        for a in data["actions"]
    ]
    return {
        "ids": ids,
        "assessment": assessment.parts[0].text,
        "outcome": data["outcome"],
        "runState": data.get("state"),
        "conflicts": conflicts,
        "claims": len(data["claims"]),
        "claimTopics": sorted({c["claim"].get("topic") for c in data["claims"]}),
        "actions": actions,
    }


def summary_of(task: Task) -> dict[str, Any]:
    m = meta(task)
    return {
        "taskId": task.id,
        "contextId": task.context_id,
        "state": state_name(task.status.state),
        "runId": m.get("convene.run_id"),
        "runState": m.get("convene.run_state"),
        "skill": m.get("convene.skill"),
        "traceId": m.get("convene.trace_id"),
        "statusText": "\n".join(p.text for p in task.status.message.parts if p.HasField("text")),
    }


def input_required(task: Task) -> bool:
    return task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED


async def refused(
    call: Awaitable[Any], error: type[A2AError], what: str
) -> str:
    """Awaits `call`, which must fail with `error`; the error's message."""
    try:
        result = await call
    except error as e:
        return str(e.message)
    except A2AError as e:
        raise Failure(f"{what}: {type(e).__name__} ({e.message}), not {error.__name__}") from e
    raise Failure(f"{what} succeeded ({type(result).__name__}), expected {error.__name__}")


# --- scenarios ---------------------------------------------------------------------


async def scenario_card(gw: Gateway) -> dict[str, Any]:
    """The public Agent Card, as the SDK's resolver reads it, with its cache headers;
    a client on the chosen binding is created from it."""
    card = await gw.card()
    interfaces = [
        {"url": i.url, "binding": i.protocol_binding, "version": i.protocol_version}
        for i in card.supported_interfaces
    ]
    check(
        interfaces
        == [
            {"url": gw.url + JSONRPC_PATH, "binding": "JSONRPC", "version": "1.0"},
            {"url": gw.url + REST_PATH, "binding": "HTTP+JSON", "version": "1.0"},
        ],
        f"interfaces {interfaces}",
    )
    check(card.capabilities.streaming, "the card does not offer streaming")
    skills = {s.id: list(s.tags) for s in card.skills}
    check(SKILL in skills, f"no skill {SKILL}: {sorted(skills)}")
    check("read-only" in skills[SKILL], f"{SKILL} is not tagged read-only: {skills[SKILL]}")
    schemes = {
        name: s.http_auth_security_scheme.scheme
        for name, s in card.security_schemes.items()
        if s.HasField("http_auth_security_scheme")
    }
    check(schemes.get("bearer") == "bearer", f"no HTTP bearer scheme: {schemes}")
    required = [sorted(r.schemes) for r in card.security_requirements]
    check(required == [["bearer"]], f"security requirements {required}")

    http = gw.http()
    response = await http.get(gw.url + "/.well-known/agent-card.json")
    check(response.status_code == 200, f"GET card: HTTP {response.status_code}")
    cache_control = response.headers.get("cache-control", "")
    etag = response.headers.get("etag", "")
    check("max-age=" in cache_control, f"Cache-Control {cache_control!r} has no max-age")
    check(etag.startswith('"') and etag.endswith('"'), f"ETag {etag!r} is not a quoted tag")

    client = await gw.client(ONCALL)
    transport_url = getattr(getattr(client, "_transport", None), "url", None)
    return {
        "name": card.name,
        "interfaces": interfaces,
        "streaming": card.capabilities.streaming,
        "skills": skills,
        "securitySchemes": schemes,
        "cacheControl": cache_control,
        "etag": etag,
        "clientUrl": transport_url,
    }


async def scenario_send_poll(gw: Gateway) -> dict[str, Any]:
    """SendMessage with returnImmediately, then GetTask until INPUT_REQUIRED; the task
    then carries the result artifacts and says what it waits for."""
    first = await start(gw)
    client = await gw.client(ONCALL)
    task, seen = await poll(client, first.id, input_required, "INPUT_REQUIRED", gw.release)
    summary = summary_of(task)
    check(summary["runId"] == meta(first).get("convene.run_id"), "the task's run changed")
    return {
        **summary,
        "firstState": state_name(first.status.state),
        "statesSeen": seen,
        "artifacts": artifacts_of(task),
    }


async def scenario_blocking(gw: Gateway) -> dict[str, Any]:
    """A blocking SendMessage answers once the run stops (INPUT_REQUIRED, with its
    artifacts); GetTask agrees; the waiting task can be cancelled."""
    client = await gw.client(ONCALL)
    started = time.monotonic()
    task = await send(client, send_request("A blocking triage.", immediately=False))
    took = time.monotonic() - started
    summary = summary_of(task)
    check(
        summary["state"] == "INPUT_REQUIRED",
        f"a blocking SendMessage answered {summary['state']}, not INPUT_REQUIRED",
    )
    artifacts = artifacts_of(task)
    again = await client.get_task(GetTaskRequest(id=task.id))
    check(
        state_name(again.status.state) == "INPUT_REQUIRED",
        f"GetTask after it says {state_name(again.status.state)}",
    )
    cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
    after = await client.get_task(GetTaskRequest(id=task.id))
    return {
        **summary,
        "seconds": round(took, 1),
        "artifacts": artifacts,
        "getTaskState": state_name(again.status.state),
        "cancelledState": state_name(cancelled.status.state),
        "afterCancelState": state_name(after.status.state),
    }


async def raw_call(
    gw: Gateway, operation: str, credential: str | None, task_id: str = ""
) -> dict[str, Any]:
    """One call on the chosen binding with plain httpx: its status and challenge."""
    headers = {VERSION_HEADER: PROTOCOL_VERSION_CURRENT}
    if credential is not None:
        headers["Authorization"] = f"Bearer {credential}"
    http = gw.http(headers=headers)
    body = MessageToDict(send_request("unauthorised", immediately=True))
    task_id = task_id or str(uuid.uuid4())
    if gw.binding == "jsonrpc":
        params = {
            "SendMessage": body,
            "GetTask": {"id": task_id},
            "ListTasks": {},
            "CancelTask": {"id": task_id},
        }[operation]
        rpc = {"jsonrpc": "2.0", "id": str(uuid.uuid4()), "method": operation, "params": params}
        response = await http.post(gw.binding_url(), json=rpc)
    else:
        base = gw.binding_url()
        if operation == "SendMessage":
            response = await http.post(f"{base}/message:send", json=body)
        elif operation == "GetTask":
            response = await http.get(f"{base}/tasks/{task_id}")
        elif operation == "ListTasks":
            response = await http.get(f"{base}/tasks")
        else:
            response = await http.post(f"{base}/tasks/{task_id}:cancel", json={"id": task_id})
    try:
        payload = response.json()
    except ValueError:
        payload = None
    return {
        "operation": operation,
        "status": response.status_code,
        "wwwAuthenticate": response.headers.get("www-authenticate"),
        "body": payload,
    }


def challenged(call: dict[str, Any], status: int, error: str | None, who: str) -> None:
    got = call["status"]
    challenge = call["wwwAuthenticate"] or ""
    check(
        got == status,
        f"{call['operation']} {who}: HTTP {got}, not {status} (body {call['body']})",
    )
    check(
        challenge.startswith("Bearer ") and 'realm="convene"' in challenge,
        f"{call['operation']} {who}: WWW-Authenticate {challenge!r} is not a convene "
        "Bearer challenge",
    )
    if error is None:
        check("error=" not in challenge, f"{who}: the challenge names an error: {challenge!r}")
    else:
        check(f'error="{error}"' in challenge, f"{who}: {challenge!r} lacks error=\"{error}\"")


async def scenario_unauthenticated(gw: Gateway) -> dict[str, Any]:
    """No bearer → 401 with a challenge; an unknown one → 401 invalid_token; a principal
    without the role → 403 insufficient_scope (on the chosen binding). The official
    client with a wrong credential fails too."""
    calls: list[dict[str, Any]] = []
    for operation in ("SendMessage", "GetTask", "ListTasks", "CancelTask"):
        missing = await raw_call(gw, operation, None)
        challenged(missing, 401, None, "without a bearer")
        wrong = await raw_call(gw, operation, "not-a-credential-" + uuid.uuid4().hex)
        challenged(wrong, 401, "invalid_token", "with an unknown bearer")
        no_roles = await raw_call(gw, operation, gw.secret(NO_RUN_ROLES))
        challenged(no_roles, 403, "insufficient_scope", f"as {NO_RUN_ROLES}")
        calls += [
            {"case": "missing", **missing},
            {"case": "wrong", **wrong},
            {"case": NO_RUN_ROLES, **no_roles},
        ]
    # Approvers read runs but may neither start nor cancel them.
    for operation in ("SendMessage", "CancelTask"):
        reader = await raw_call(gw, operation, gw.secret(ALICE))
        challenged(reader, 403, "insufficient_scope", f"as {ALICE}")
        calls.append({"case": ALICE, **reader})
    listed = await raw_call(gw, "ListTasks", gw.secret(ALICE))
    check(listed["status"] == 200, f"ListTasks as {ALICE}: HTTP {listed['status']}")

    wrong_client = ClientFactory(
        ClientConfig(
            streaming=False,
            httpx_client=gw.http(),
            supported_protocol_bindings=[BINDINGS[gw.binding]],
        )
    ).create(
        await gw.card(),
        interceptors=[AuthInterceptor(PrincipalCredentials("not-a-credential"))],
    )
    try:
        await wrong_client.list_tasks(ListTasksRequest())
        raise Failure("ListTasks with an unknown credential succeeded in the official client")
    except A2AError as e:
        client_error = type(e).__name__
    finally:
        await wrong_client.close()

    return {
        "calls": [
            {k: c[k] for k in ("case", "operation", "status", "wwwAuthenticate")} for c in calls
        ],
        "readerListTasks": listed["status"],
        "clientError": client_error,
    }


async def scenario_cancel_running(gw: Gateway) -> dict[str, Any]:
    """CancelTask right after a returnImmediately SendMessage: CANCELED."""
    task = await start(gw)
    client = await gw.client(ONCALL)
    cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
    after = await client.get_task(GetTaskRequest(id=task.id))
    return {
        **summary_of(after),
        "startedState": state_name(task.status.state),
        "cancelledState": state_name(cancelled.status.state),
    }


async def scenario_cancel_ended(gw: Gateway) -> dict[str, Any]:
    """A task that ended (cancelled) cannot be cancelled again: TaskNotCancelable; it
    keeps its state."""
    task = await start(gw)
    client = await gw.client(ONCALL)
    cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
    check(
        state_name(cancelled.status.state) == "CANCELED",
        f"the first CancelTask answered {state_name(cancelled.status.state)}",
    )
    error = await refused(
        client.cancel_task(CancelTaskRequest(id=task.id)),
        TaskNotCancelableError,
        "CancelTask of a cancelled task",
    )
    after = await client.get_task(GetTaskRequest(id=task.id))
    return {
        **summary_of(after),
        "cancelledState": state_name(cancelled.status.state),
        "secondCancel": "TaskNotCancelable",
        "secondCancelMessage": error,
    }


async def scenario_not_found(gw: Gateway) -> dict[str, Any]:
    """An unknown task id, and another principal's (another tenant's) task, are
    TaskNotFound; ListTasks shows callers their own tasks only."""
    oncall = await gw.client(ONCALL)
    unknown = str(uuid.uuid4())
    errors = {
        "getUnknown": await refused(
            oncall.get_task(GetTaskRequest(id=unknown)), TaskNotFoundError, "GetTask of an unknown id"
        ),
        "cancelUnknown": await refused(
            oncall.cancel_task(CancelTaskRequest(id=unknown)),
            TaskNotFoundError,
            "CancelTask of an unknown id",
        ),
    }
    task = await start(gw)
    analyst = await gw.client(ANALYST)
    errors["getOthers"] = await refused(
        analyst.get_task(GetTaskRequest(id=task.id)),
        TaskNotFoundError,
        f"GetTask of {ONCALL}'s task as {ANALYST}",
    )
    errors["cancelOthers"] = await refused(
        analyst.cancel_task(CancelTaskRequest(id=task.id)),
        TaskNotFoundError,
        f"CancelTask of {ONCALL}'s task as {ANALYST}",
    )
    analyst_stream = await gw.client(ANALYST, streaming=True)

    async def subscribe() -> None:
        async for _ in analyst_stream.subscribe(SubscribeToTaskRequest(id=task.id)):
            raise Failure(f"SubscribeToTask of {ONCALL}'s task as {ANALYST} gave an event")

    errors["subscribeOthers"] = await refused(
        subscribe(), TaskNotFoundError, f"SubscribeToTask of {ONCALL}'s task as {ANALYST}"
    )
    theirs = await analyst.list_tasks(ListTasksRequest())
    mine = await oncall.list_tasks(ListTasksRequest())
    analyst_ids = [t.id for t in theirs.tasks]
    oncall_ids = [t.id for t in mine.tasks]
    check(task.id not in analyst_ids, f"{ANALYST} lists {ONCALL}'s task {task.id}")
    check(task.id in oncall_ids, f"{ONCALL} does not list its own task {task.id}: {oncall_ids}")
    # The task was not touched by the other principal's cancel.
    still = await oncall.get_task(GetTaskRequest(id=task.id))
    check(
        state_name(still.status.state) != "CANCELED",
        f"{ANALYST}'s CancelTask cancelled {ONCALL}'s task",
    )
    await oncall.cancel_task(CancelTaskRequest(id=task.id))
    return {
        "taskId": task.id,
        "errors": errors,
        "analystListed": analyst_ids,
        "analystTotal": theirs.total_size,
        "oncallListed": oncall_ids,
        "stateAfterOthersCancel": state_name(still.status.state),
    }


def event_kind(event: StreamResponse) -> str:
    return event.WhichOneof("payload") or "none"


def describe(event: StreamResponse) -> dict[str, Any]:
    kind = event_kind(event)
    if kind == "task":
        return {"kind": kind, "state": state_name(event.task.status.state), "taskId": event.task.id}
    if kind == "status_update":
        return {
            "kind": kind,
            "state": state_name(event.status_update.status.state),
            "taskId": event.status_update.task_id,
        }
    if kind == "artifact_update":
        return {
            "kind": kind,
            "artifactId": event.artifact_update.artifact.artifact_id,
            "taskId": event.artifact_update.task_id,
        }
    return {"kind": kind}


async def first_and_rest(events: Any, what: str) -> tuple[list[StreamResponse], Any]:
    """Waits for a stream's first event: a list holding it, and the stream's iterator
    for the rest."""
    iterator = events.__aiter__()
    try:
        first = await asyncio.wait_for(anext(iterator), RUN_LIMIT)
    except StopAsyncIteration as e:
        raise Failure(f"{what} ended without an event") from e
    except TimeoutError as e:
        raise Failure(f"{what} gave no event within {RUN_LIMIT:.0f}s") from e
    return [first], iterator


async def drain(out: list[StreamResponse], iterator: Any, what: str) -> list[StreamResponse]:
    """Appends the rest of a stream's events to `out` until it ends (the task
    stopped), within the run limit."""

    async def rest() -> None:
        async for event in iterator:
            out.append(event)

    try:
        await asyncio.wait_for(rest(), RUN_LIMIT)
    except TimeoutError as e:
        raise Failure(
            f"{what} did not end within {RUN_LIMIT:.0f}s; events: {[describe(x) for x in out]}"
        ) from e
    return out


def check_stream(events: list[StreamResponse], what: str) -> list[dict[str, Any]]:
    """A stream that follows a task until INPUT_REQUIRED: a Task first (still going),
    status updates, the result artifacts, then a status update to INPUT_REQUIRED last."""
    seen = [describe(e) for e in events]
    check(seen[0]["kind"] == "task", f"{what}: the first event is not a Task: {seen}")
    check(
        seen[0]["state"] in ("SUBMITTED", "WORKING"),
        f"{what}: the first Task is {seen[0]['state']}, not SUBMITTED or WORKING: {seen}",
    )
    task_id = seen[0]["taskId"]
    check(
        all(e.get("taskId") == task_id for e in seen),
        f"{what}: events of another task: {seen}",
    )
    check(
        seen[-1] == {"kind": "status_update", "state": "INPUT_REQUIRED", "taskId": task_id},
        f"{what}: the last event is not a status update to INPUT_REQUIRED: {seen}",
    )
    artifacts = [i for i, e in enumerate(seen) if e["kind"] == "artifact_update"]
    check(
        [seen[i]["artifactId"] for i in artifacts] == ["assessment", "decision"],
        f"{what}: artifact updates {seen}, not assessment then decision",
    )
    check(
        all(e["kind"] == "status_update" for e in seen[1 : artifacts[0]]),
        f"{what}: before the artifacts only status updates may come: {seen}",
    )
    check(artifacts == [len(seen) - 3, len(seen) - 2], f"{what}: the artifacts do not come last: {seen}")
    decision = events[artifacts[-1]].artifact_update.artifact
    check(
        bool(decision.parts) and decision.parts[0].HasField("data"),
        f"{what}: the decision artifact update has no data part",
    )
    return seen


async def scenario_stream(gw: Gateway) -> dict[str, Any]:
    """SubscribeToTask on a running task and SendStreamingMessage: each the Task first
    (still going), then the result artifacts, then a status update to INPUT_REQUIRED;
    the stream then ends. Held delegations (`--release`) are let go once both streams
    have given their first event."""
    running = await start(gw)
    streaming = await gw.client(ONCALL, streaming=True)
    subscribed, sub_rest = await first_and_rest(
        streaming.subscribe(SubscribeToTaskRequest(id=running.id)), "SubscribeToTask"
    )
    request = send_request("A streamed triage.", immediately=False)
    sent, sent_rest = await first_and_rest(streaming.send_message(request), "SendStreamingMessage")
    gw.release()
    sub_seen = check_stream(
        await drain(subscribed, sub_rest, "SubscribeToTask"), "SubscribeToTask"
    )
    check(sub_seen[0]["taskId"] == running.id, f"SubscribeToTask followed another task: {sub_seen}")
    sent_seen = check_stream(
        await drain(sent, sent_rest, "SendStreamingMessage"), "SendStreamingMessage"
    )
    oncall = await gw.client(ONCALL)
    final = {
        t: state_name((await oncall.get_task(GetTaskRequest(id=t))).status.state)
        for t in (running.id, sent_seen[0]["taskId"])
    }
    check(
        set(final.values()) == {"INPUT_REQUIRED"},
        f"GetTask after the streams ended: {final}",
    )
    # A task that has stopped (INPUT_REQUIRED) has nothing more to stream: the Task with
    # its artifacts, then the stream ends.
    stopped, stopped_rest = await first_and_rest(
        streaming.subscribe(SubscribeToTaskRequest(id=running.id)), "SubscribeToTask (stopped)"
    )
    stopped_seen = [
        describe(e) for e in await drain(stopped, stopped_rest, "SubscribeToTask (stopped)")
    ]
    check(
        len(stopped_seen) == 1
        and stopped_seen[0]["kind"] == "task"
        and stopped_seen[0].get("state") == "INPUT_REQUIRED",
        f"SubscribeToTask of a stopped task: {stopped_seen}",
    )
    return {
        "subscribeStopped": stopped_seen,
        "subscribe": {"taskId": running.id, "events": sub_seen},
        "sendStreaming": {"taskId": sent_seen[0]["taskId"], "events": sent_seen},
        "finalStates": final,
    }


async def scenario_tighten(gw: Gateway) -> dict[str, Any]:
    """Metadata that weakens the template is refused with INVALID_PARAMS naming the
    field; a tightening one is accepted."""
    client = await gw.client(ONCALL)
    errors = {}
    for name, metadata in {
        "join": {"convene.join": {"minimum": {"count": 1}}},
        "limits": {"convene.limits": {"maxToolCalls": 1000}},
    }.items():
        errors[name] = await refused(
            send(client, send_request("weaker", immediately=True, metadata=metadata)),
            InvalidParamsError,
            f"SendMessage with a weaker convene.{name}",
        )
    check("join.minimum.count" in errors["join"], f"the join error names no field: {errors['join']}")
    check(
        "limits.max_tool_calls" in errors["limits"],
        f"the limits error names no field: {errors['limits']}",
    )
    tighter = await send(
        client,
        send_request(
            "tighter",
            immediately=True,
            metadata={
                "convene.join": {"minimum": {"count": 3}},
                "convene.limits": {"maxToolCalls": 12},
            },
        ),
    )
    await client.cancel_task(CancelTaskRequest(id=tighter.id))
    listed = await client.list_tasks(ListTasksRequest())
    return {
        "errors": errors,
        "tighterTaskId": tighter.id,
        "tighterState": state_name(tighter.status.state),
        "tasks": len(listed.tasks),
    }


async def scenario_traced(gw: Gateway, traceparent: str) -> dict[str, Any]:
    """SendMessage (returnImmediately) carrying the caller's W3C `traceparent`; the
    task's run and trace ids, for the caller to find the spans. The task is cancelled
    at once, so that its run ends and the run's span is exported."""
    client = await gw.client(ONCALL)
    context = ClientCallContext(service_parameters={"traceparent": traceparent})
    task = await send(
        client, send_request("A traced triage.", immediately=True), context=context
    )
    await client.cancel_task(CancelTaskRequest(id=task.id))
    return {**summary_of(task), "traceparent": traceparent}


SCENARIOS = {
    "card": scenario_card,
    "send-poll": scenario_send_poll,
    "blocking": scenario_blocking,
    "unauthenticated": scenario_unauthenticated,
    "cancel-running": scenario_cancel_running,
    "cancel-ended": scenario_cancel_ended,
    "not-found": scenario_not_found,
    "stream": scenario_stream,
    "tighten": scenario_tighten,
    "traced": scenario_traced,
}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--url", required=True, help="the gateway's base URL")
    parser.add_argument(
        "--credentials",
        required=True,
        type=Path,
        help="the directory of the principals' <principal>.secret files",
    )
    parser.add_argument("--binding", choices=sorted(BINDINGS), default="jsonrpc")
    parser.add_argument(
        "--release",
        type=Path,
        help="the release file of the workers' `hold`, when the mesh holds delegations: "
        "created once the scenario has seen its task still going",
    )
    parser.add_argument(
        "--traceparent", help="for `traced`: the W3C traceparent to send (00-<trace>-<span>-01)"
    )
    args = parser.parse_args()
    gw = Gateway(args.url, args.credentials, args.binding, args.release)
    try:
        if args.scenario == "traced":
            if not args.traceparent:
                parser.error("traced needs --traceparent")
            summary = await scenario_traced(gw, args.traceparent)
        else:
            summary = await SCENARIOS[args.scenario](gw)
    except Failure as e:
        print(f"FAIL: {args.scenario} over {args.binding}: {e}", file=sys.stderr)
        return 1
    except A2AError as e:
        print(
            f"FAIL: {args.scenario} over {args.binding}: the gateway answered "
            f"{type(e).__name__}: {e.message}",
            file=sys.stderr,
        )
        return 1
    finally:
        await gw.close()
    print(json.dumps({"scenario": args.scenario, "binding": args.binding, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
