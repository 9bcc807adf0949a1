#!/usr/bin/env python3
"""The payment incident against a running convene mesh, over gRPC from Python.

Starts examples/payment-incident/run.yaml, prints one line per progress event of the
run, prints the join's decision and the conflict it leaves open, settles the conflict
(as the main principal, who holds the `runs:resolve` role), approves the R3 rollback
request as two distinct approvers, executes it as the first, and prints the final state.
Exits 0 once the run has SUCCEEDED, 1 with a message on any failure.

    clients/generate.sh                                  # the stubs, once
    python clients/python/payment_incident.py --data-dir .convene

The main principal's credential is CONVENE_CREDENTIAL, else that of the default
principal `convene up` records in <data-dir>/credentials; the approvers' come from
<data-dir>/credentials/<principal>.secret. Every call carries
`authorization: Bearer <credential>`.
"""

import argparse
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE / "gen"))

try:
    import grpc
    import yaml
    from google.protobuf import json_format

    from convene.v1 import approval_pb2, approval_pb2_grpc, run_pb2
    from convene.v1 import supervisor_pb2, supervisor_pb2_grpc
except ImportError as missing:
    sys.exit(
        f"payment_incident.py: {missing}. Install the packages of "
        f"{HERE / 'requirements.txt'} and generate the stubs with clients/generate.sh."
    )

DEFAULT_ENDPOINT = "http://127.0.0.1:7400"
CALL_TIMEOUT = 30.0
FINAL = {"RUN_STATE_SUCCEEDED", "RUN_STATE_PARTIAL", "RUN_STATE_FAILED",
         "RUN_STATE_CANCELLED"}


class Failure(Exception):
    """A step that could not be done, with what to do about it."""


def enum_name(message, field):
    """The name of the enum value `message.field` holds, e.g. RUN_STATE_SUCCEEDED."""
    enum = message.DESCRIPTOR.fields_by_name[field].enum_type
    number = getattr(message, field)
    value = enum.values_by_number.get(number)
    return value.name if value else str(number)


def read_credential(data_dir, principal):
    path = data_dir / "credentials" / f"{principal}.secret"
    try:
        return path.read_text().strip()
    except OSError as e:
        raise Failure(
            f"no credential for {principal} at {path} ({e.strerror}): pass --data-dir, the "
            "data directory `convene up` keeps its state in"
        ) from None


def main_identity(data_dir):
    """(principal, credential) of the main principal."""
    given = os.environ.get("CONVENE_CREDENTIAL", "").strip()
    if given:
        return "the CONVENE_CREDENTIAL principal", given
    default = data_dir / "credentials" / "default-principal"
    try:
        principal = default.read_text().strip()
    except OSError:
        raise Failure(
            f"no credential: set CONVENE_CREDENTIAL, or pass --data-dir, the data directory "
            f"`convene up` keeps its state in ({default} does not exist)"
        ) from None
    return principal, read_credential(data_dir, principal)


def open_channel(endpoint):
    if endpoint.startswith("https://"):
        return grpc.secure_channel(endpoint[len("https://"):].rstrip("/"),
                                   grpc.ssl_channel_credentials())
    if endpoint.startswith("http://"):
        endpoint = endpoint[len("http://"):]
    return grpc.insecure_channel(endpoint.rstrip("/"))


def explain(error, endpoint, principal):
    """A gRPC error as a message that says what to do."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach convene at {endpoint}: is `convene up` running? ({details})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"not authenticated as {principal}: {details}"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"not permitted as {principal}: {details}"
    return f"{details} ({code.name})"


class Session:
    """The mesh at one endpoint, and who acts."""

    def __init__(self, endpoint, data_dir):
        self.endpoint = endpoint
        self.data_dir = data_dir
        self.channel = open_channel(endpoint)
        self.supervisor = supervisor_pb2_grpc.SupervisorStub(self.channel)
        # `convene up` serves the approval service on the same endpoint.
        self.approval = approval_pb2_grpc.ApprovalStub(self.channel)
        self.principal, self.credential = main_identity(data_dir)
        self.names = {}

    def call(self, method, request, principal=None, credential=None):
        principal = principal or self.principal
        metadata = (("authorization", f"Bearer {credential or self.credential}"),)
        try:
            return method(request, metadata=metadata, timeout=CALL_TIMEOUT)
        except grpc.RpcError as e:
            raise Failure(explain(e, self.endpoint, principal)) from None

    def get_run(self, run_id):
        return self.call(self.supervisor.GetRun,
                         supervisor_pb2.GetRunRequest(run_id=run_id)).run

    def follow(self, run, after, watch_timeout):
        """Prints the run's events after sequence `after` until it ends or waits for
        people now; the last sequence seen."""
        metadata = (("authorization", f"Bearer {self.credential}"),)
        stream = self.supervisor.WatchRun(
            supervisor_pb2.WatchRunRequest(run_id=run.run_id, after_sequence=after),
            metadata=metadata, timeout=watch_timeout)
        try:
            for item in stream:
                event = item.event
                after = max(after, event.sequence)
                if self.show(event) and self.stops_here(event):
                    break
        except grpc.RpcError as e:
            raise Failure(f"watching run {run.run_id}: "
                          f"{explain(e, self.endpoint, self.principal)}") from None
        finally:
            stream.cancel()
        return after

    def stops_here(self, event):
        """Whether the run is still in the wait a `waiting` event announced (watched from
        the start, a resumed run replays its earlier waits too); a terminal event stops."""
        if event.WhichOneof("kind") == "terminal":
            return True
        now = self.get_run(event.run_id)
        return (enum_name(now, "state").startswith("RUN_STATE_WAITING")
                and now.ticket.id == event.waiting.ticket.id)

    def show(self, event):
        """Prints one line for a progress event; True for a waiting or terminal one."""
        kind = event.WhichOneof("kind")
        if kind == "dispatched":
            d = event.dispatched
            self.names.setdefault(d.delegation_id, d.name)
            print(f"  {d.name:<10} dispatched to {d.worker_id} (attempt {d.attempt})")
        elif kind == "completed":
            c = event.completed
            status = enum_name(c, "status").removeprefix("TASK_STATUS_")
            late = " (late)" if c.late else ""
            print(f"  {self.names.get(c.delegation_id, c.name):<10} {status}{late}: {c.summary}")
        elif kind == "decision":
            print(f"  join       revision {event.decision.revision}: "
                  f"{enum_name(event.decision, 'outcome')}")
        elif kind == "planned":
            print(f"  planner    round {event.planned.round}, turn {event.planned.turn}")
        elif kind == "resumed":
            r = event.resumed
            print(f"  resumed    {r.input} by {r.by}" + (f": {r.detail}" if r.detail else ""))
        elif kind == "waiting":
            print(f"  waiting    {enum_name(event.waiting, 'state')}: {event.waiting.reason}")
            return True
        elif kind == "terminal":
            print(f"  ended      {enum_name(event.terminal, 'state')}: {event.terminal.reason}")
            return True
        elif kind == "started":
            print(f"  started    run {event.started.run_id}")
        return False


def load_spec(path, idempotency_key):
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise Failure(f"cannot read the run spec {path}: {e}") from None
    spec = run_pb2.RunSpec()
    try:
        # The spec file is a RunSpec in the protobuf JSON mapping.
        json_format.ParseDict(doc, spec)
    except json_format.ParseError as e:
        raise Failure(f"{path} is not a convene.v1.RunSpec: {e}") from None
    if idempotency_key:
        spec.idempotency_key = idempotency_key
    return spec


def print_decision(run, names):
    d = run.decision
    print(f"\nDecision (revision {d.revision}): {enum_name(d, 'outcome')}")
    for reason in d.reasons:
        print(f"  - {reason}")
    for conflict in d.conflicts:
        print(f"Conflict on {conflict.topic}: {enum_name(conflict, 'resolution')}")
        for claim in conflict.claims:
            name = names.get(claim.delegation_id, claim.delegation_id)
            print(f"  {name} says {claim.value}: {claim.statement} "
                  f"(evidence {', '.join(claim.evidence_refs)})")


def settle(s, run, choose, rationale):
    """Settles the run's first open conflict by choosing the side of delegation `choose`
    (a name or an id), under the run's current ticket, as `convene runs resolve` does."""
    open_ = [c for c in run.decision.conflicts
             if enum_name(c, "resolution") != "CONFLICT_RESOLUTION_SETTLED"]
    if not open_:
        raise Failure(f"run {run.run_id} waits for input but has no open conflict to settle")
    conflict = open_[0]
    sides = [c.delegation_id for c in conflict.claims]
    chosen = [i for i in sides if choose in (i, s.names.get(i))]
    if not chosen:
        raise Failure(
            f"no side of the conflict on {conflict.topic} is {choose!r}; pass --choose with "
            f"one of: {', '.join(f'{s.names.get(i, i)} ({i})' for i in sides)}")
    print(f"\nSettling {conflict.topic}: choosing {choose} ({chosen[0]}) as {s.principal}, "
          f"under the run's current ticket {run.ticket.id} (wait {run.ticket.version})")
    resp = s.call(s.supervisor.ResumeRun, supervisor_pb2.ResumeRunRequest(
        run_id=run.run_id, ticket=run.ticket, rationale=rationale,
        settle=supervisor_pb2.SettleConflict(topic=conflict.topic,
                                             delegation_id=chosen[0])))
    print(f"ResumeRun: {enum_name(resp, 'outcome')}")


def approve_and_execute(s, run, approvers):
    """Approves each pending approval request of the run as every approver, each vote
    bound to the parameters hash the listing shows, then executes it as the first."""
    listed = s.call(s.approval.ListApprovals, approval_pb2.ListApprovalsRequest(
        run_id=run.run_id, states=[approval_pb2.APPROVAL_STATE_PENDING]))
    if not listed.approvals:
        raise Failure(f"run {run.run_id} waits for approval but has no pending request")
    creds = {p: read_credential(s.data_dir, p) for p in approvers}
    for request in listed.approvals:
        print(f"\nApproval request {request.approval_id}: {request.action}, "
              f"{enum_name(request, 'risk_level')}, {request.approvals_required} approval(s) "
              f"required\n  parameters hash {request.parameters_hash}")
        for approver in approvers:
            decided = s.call(s.approval.Decide, approval_pb2.DecideRequest(
                approval_id=request.approval_id,
                decision=approval_pb2.VOTE_DECISION_APPROVE,
                parameters_hash=request.parameters_hash,
                comment="rollback reviewed"), approver, creds[approver]).approval
            print(f"  approved as {approver}: {enum_name(decided, 'state')} "
                  f"({len(decided.votes)} vote(s))")
        executor = approvers[0]
        done = s.call(s.approval.Execute, approval_pb2.ApprovalExecuteRequest(
            approval_id=request.approval_id, parameters_hash=request.parameters_hash),
            executor, creds[executor])
        rec = done.execution
        print(f"  {'executed now' if done.executed_now else 'already executed'} "
              f"by {rec.executed_by} with executor {rec.executor} (success: {rec.success})")


def run_incident(args):
    spec = load_spec(pathlib.Path(args.spec), args.idempotency_key)
    s = Session(args.endpoint, pathlib.Path(args.data_dir))
    started = s.call(s.supervisor.StartRun, supervisor_pb2.StartRunRequest(spec=spec))
    run = started.run
    for d in run.delegations:
        s.names[d.task.delegation_id] = d.task.name
    verb = "accepted" if started.created else "already exists for this idempotency key;"
    print(f"Run {run.run_id} {verb} as {s.principal}: {len(run.delegations)} delegation(s), "
          f"trace {run.trace_id}")
    after = 0
    # Each stop is a wait for people or the end; a few rounds suffice for this incident.
    for _ in range(6):
        after = s.follow(run, after, args.timeout)
        run = s.get_run(run.run_id)
        state = enum_name(run, "state")
        if state in FINAL:
            break
        if state == "RUN_STATE_WAITING_INPUT":
            print_decision(run, s.names)
            settle(s, run, args.choose, args.rationale)
        elif state == "RUN_STATE_WAITING_APPROVAL":
            approve_and_execute(s, run, args.approvers.split(","))
        else:
            raise Failure(f"run {run.run_id} stopped in {state}, which this program "
                          "does not handle")
    print_decision(run, s.names)
    print(f"\nFinal state: {enum_name(run, 'state')}")
    for action in run.actions:
        print(f"Action {action.action}: {enum_name(action, 'state')}, approved by "
              f"{', '.join(action.decided_by)}; executed by {action.execution.executed_by}")
    if enum_name(run, "state") != "RUN_STATE_SUCCEEDED":
        raise Failure(f"run {run.run_id} ended {enum_name(run, 'state')}, not "
                      f"SUCCEEDED: {run.terminal_reason}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint",
                        default=os.environ.get("CONVENE_ENDPOINT", DEFAULT_ENDPOINT),
                        help="the mesh (CONVENE_ENDPOINT; default %(default)s)")
    parser.add_argument("--data-dir", default=os.environ.get("CONVENE_DATA_DIR", ".convene"),
                        help="data directory of `convene up`, whose credentials/ holds the "
                             "development credentials (CONVENE_DATA_DIR; default %(default)s)")
    parser.add_argument("--spec", default=str(REPO / "examples/payment-incident/run.yaml"),
                        help="the run spec (default: the payment incident)")
    parser.add_argument("--idempotency-key",
                        help="start a run under this key instead of the spec's")
    parser.add_argument("--choose", default="changes",
                        help="the side to settle the conflict on (default %(default)s)")
    parser.add_argument("--rationale", default="RC-4711 went live 20 s before the drop",
                        help="why, recorded with the settlement")
    parser.add_argument("--approvers", default="alice@acme,bob@acme",
                        help="comma-separated approvers; the first executes "
                             "(default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to follow the run before each wait (default %(default)s)")
    args = parser.parse_args()
    try:
        run_incident(args)
    except Failure as e:
        sys.exit(f"payment_incident.py: {e}")


if __name__ == "__main__":
    main()
