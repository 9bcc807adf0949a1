#!/usr/bin/env node
// The payment incident against a running convene mesh, over gRPC from Node.
//
// Starts examples/payment-incident/run.yaml, prints one line per progress event of the
// run, prints the join's decision and the conflict it leaves open, settles the conflict
// (as the main principal, who holds the `runs:resolve` role), approves the R3 rollback
// request as two distinct approvers, executes it as the first, and prints the final
// state. Exits 0 once the run has SUCCEEDED, 1 with a message on any failure.
//
//     npm ci                                            # in clients/node, once
//     node clients/node/payment_incident.js --data-dir .convene
//
// The stubs come from proto/ at run time (@grpc/proto-loader): nothing to generate. The
// main principal's credential is CONVENE_CREDENTIAL, else that of the default principal
// `convene up` records in <data-dir>/credentials; the approvers' come from
// <data-dir>/credentials/<principal>.secret. Every call carries
// `authorization: Bearer <credential>`.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const yaml = require('js-yaml');

const REPO = path.resolve(__dirname, '..', '..');
const PROTO_DIR = path.join(REPO, 'proto');
const PROTO_FILES = ['convene/v1/supervisor.proto', 'convene/v1/approval.proto'];
const DEFAULT_ENDPOINT = 'http://127.0.0.1:7400';
const CALL_TIMEOUT_MS = 30_000;
const FINAL = new Set([
  'RUN_STATE_SUCCEEDED',
  'RUN_STATE_PARTIAL',
  'RUN_STATE_FAILED',
  'RUN_STATE_CANCELLED',
]);

/** A step that could not be done, with what to do about it. */
class Failure extends Error {}

const USAGE = `usage: node payment_incident.js [--endpoint URL] [--data-dir DIR] [--spec FILE]
       [--idempotency-key KEY] [--choose SIDE] [--rationale TEXT]
       [--approvers P1,P2] [--timeout SECONDS]

  --endpoint         the mesh (CONVENE_ENDPOINT; default ${DEFAULT_ENDPOINT})
  --data-dir         data directory of \`convene up\`, whose credentials/ holds the
                     development credentials (CONVENE_DATA_DIR; default .convene)
  --spec             the run spec (default: examples/payment-incident/run.yaml)
  --idempotency-key  start a run under this key instead of the spec's
  --choose           the side to settle the conflict on (default changes)
  --rationale        why, recorded with the settlement
  --approvers        comma-separated approvers; the first executes
                     (default alice@acme,bob@acme)
  --timeout          seconds to follow the run before each wait (default 300)`;

function options() {
  let parsed;
  try {
    parsed = parseArgs({
      options: {
        endpoint: { type: 'string', default: process.env.CONVENE_ENDPOINT || DEFAULT_ENDPOINT },
        'data-dir': { type: 'string', default: process.env.CONVENE_DATA_DIR || '.convene' },
        spec: {
          type: 'string',
          default: path.join(REPO, 'examples', 'payment-incident', 'run.yaml'),
        },
        'idempotency-key': { type: 'string' },
        choose: { type: 'string', default: 'changes' },
        rationale: { type: 'string', default: 'RC-4711 went live 20 s before the drop' },
        approvers: { type: 'string', default: 'alice@acme,bob@acme' },
        timeout: { type: 'string', default: '300' },
        help: { type: 'boolean', short: 'h' },
      },
    });
  } catch (e) {
    throw new Failure(`${e.message}\n${USAGE}`);
  }
  const { values } = parsed;
  if (values.help) {
    console.log(USAGE);
    process.exit(0);
  }
  const timeout = Number(values.timeout);
  if (!(timeout > 0)) throw new Failure(`--timeout ${values.timeout}: give seconds, above 0`);
  return { ...values, timeout };
}

function readCredential(dataDir, principal) {
  const file = path.join(dataDir, 'credentials', `${principal}.secret`);
  try {
    return fs.readFileSync(file, 'utf8').trim();
  } catch (e) {
    throw new Failure(
      `no credential for ${principal} at ${file} (${e.code}): pass --data-dir, the data ` +
        'directory `convene up` keeps its state in',
    );
  }
}

/** [principal, credential] of the main principal. */
function mainIdentity(dataDir) {
  const given = (process.env.CONVENE_CREDENTIAL || '').trim();
  if (given) return ['the CONVENE_CREDENTIAL principal', given];
  const file = path.join(dataDir, 'credentials', 'default-principal');
  let principal;
  try {
    principal = fs.readFileSync(file, 'utf8').trim();
  } catch {
    throw new Failure(
      'no credential: set CONVENE_CREDENTIAL, or pass --data-dir, the data directory ' +
        `\`convene up\` keeps its state in (${file} does not exist)`,
    );
  }
  return [principal, readCredential(dataDir, principal)];
}

function channel(endpoint) {
  if (endpoint.startsWith('https://')) {
    return [endpoint.slice('https://'.length).replace(/\/+$/, ''), grpc.credentials.createSsl()];
  }
  const target = endpoint.startsWith('http://') ? endpoint.slice('http://'.length) : endpoint;
  return [target.replace(/\/+$/, ''), grpc.credentials.createInsecure()];
}

/** A gRPC error as a message that says what to do. */
function explain(err, endpoint, principal) {
  const name = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || err.code;
  switch (err.code) {
    case grpc.status.UNAVAILABLE:
      return `cannot reach convene at ${endpoint}: is \`convene up\` running? (${err.details})`;
    case grpc.status.UNAUTHENTICATED:
      return `not authenticated as ${principal}: ${err.details}`;
    case grpc.status.PERMISSION_DENIED:
      return `not permitted as ${principal}: ${err.details}`;
    default:
      return `${err.details} (${name})`;
  }
}

// Protobuf JSON mapping (what the spec file is) to the objects proto-loader sends: names
// may be snake_case or lowerCamelCase, Duration and Timestamp are strings, enums names.
const lowerCamel = (name) => name.replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase());

function duration(text, at) {
  const m = /^(-)?(\d+)(?:\.(\d{1,9}))?s$/.exec(String(text));
  if (!m) throw new Failure(`${at}: ${JSON.stringify(text)} is not a duration like "15s"`);
  const sign = m[1] ? -1 : 1;
  return {
    seconds: String(sign * Number(m[2])),
    nanos: sign * Number((m[3] || '').padEnd(9, '0')),
  };
}

function timestamp(text, at) {
  const m = /^(.*T\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$/.exec(String(text));
  const ms = m ? Date.parse(`${m[1]}${m[3]}`) : NaN;
  if (Number.isNaN(ms)) {
    throw new Failure(`${at}: ${JSON.stringify(text)} is not an RFC 3339 time`);
  }
  return { seconds: String(ms / 1000), nanos: Number((m[2] || '').padEnd(9, '0')) };
}

function fromJson(type, value, at) {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    throw new Failure(`${at}: expected an object (a ${type.fullName.slice(1)})`);
  }
  const out = {};
  for (const [key, item] of Object.entries(value)) {
    const field = type.fieldsArray.find((f) => f.name === key || lowerCamel(f.name) === key);
    if (!field) throw new Failure(`${at}: unknown field ${JSON.stringify(key)}`);
    const where = `${at}.${field.name}`;
    if (item === null) continue;
    if (field.map) {
      out[field.name] = Object.fromEntries(
        Object.entries(item).map(([k, v]) => [k, element(field, v, `${where}.${k}`)]),
      );
    } else if (field.repeated) {
      if (!Array.isArray(item)) throw new Failure(`${where}: expected a list`);
      out[field.name] = item.map((v, i) => element(field, v, `${where}[${i}]`));
    } else {
      out[field.name] = element(field, item, where);
    }
  }
  return out;
}

function element(field, value, at) {
  const t = field.resolvedType;
  if (t instanceof protobuf.Enum) {
    if (!(value in t.values) && !Object.values(t.values).includes(value)) {
      throw new Failure(`${at}: ${JSON.stringify(value)} is not a ${t.name}`);
    }
    return value;
  }
  if (t instanceof protobuf.Type) {
    if (t.fullName === '.google.protobuf.Duration') return duration(value, at);
    if (t.fullName === '.google.protobuf.Timestamp') return timestamp(value, at);
    if (t.fullName.startsWith('.google.protobuf.')) {
      throw new Failure(`${at}: ${t.fullName.slice(1)} fields are not read by this example`);
    }
    return fromJson(t, value, at);
  }
  return value;
}

function loadSpec(file, idempotencyKey) {
  let doc;
  try {
    doc = yaml.load(fs.readFileSync(file, 'utf8'));
  } catch (e) {
    throw new Failure(`cannot read the run spec ${file}: ${e.message}`);
  }
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => path.join(PROTO_DIR, target);
  root.loadSync('convene/v1/run.proto', { keepCase: true }).resolveAll();
  let spec;
  try {
    spec = fromJson(root.lookupType('convene.v1.RunSpec'), doc, 'spec');
  } catch (e) {
    if (e instanceof Failure)
      throw new Failure(`${file} is not a convene.v1.RunSpec: ${e.message}`);
    throw e;
  }
  if (idempotencyKey) spec.idempotency_key = idempotencyKey;
  return spec;
}

/** The mesh at one endpoint, and who acts. */
class Session {
  constructor(endpoint, dataDir) {
    const definition = protoLoader.loadSync(PROTO_FILES, {
      includeDirs: [PROTO_DIR],
      keepCase: true,
      longs: String,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    const v1 = grpc.loadPackageDefinition(definition).convene.v1;
    const [target, creds] = channel(endpoint);
    this.endpoint = endpoint;
    this.dataDir = dataDir;
    this.supervisor = new v1.Supervisor(target, creds);
    // `convene up` serves the approval service on the same endpoint.
    this.approval = new v1.Approval(target, creds, {
      channelOverride: this.supervisor.getChannel(),
    });
    [this.principal, this.credential] = mainIdentity(dataDir);
    this.names = new Map();
  }

  metadata(credential) {
    const md = new grpc.Metadata();
    md.set('authorization', `Bearer ${credential}`);
    return md;
  }

  call(client, method, request, principal = this.principal, credential = this.credential) {
    return new Promise((resolve, reject) => {
      client[method](
        request,
        this.metadata(credential),
        { deadline: Date.now() + CALL_TIMEOUT_MS },
        (err, resp) =>
          err ? reject(new Failure(explain(err, this.endpoint, principal))) : resolve(resp),
      );
    });
  }

  async getRun(runId) {
    return (await this.call(this.supervisor, 'GetRun', { run_id: runId })).run;
  }

  /** Prints the run's events after sequence `after` until it ends or waits for people
   * now; the last sequence seen. */
  async follow(runId, after, timeoutSeconds) {
    const call = this.supervisor.WatchRun(
      { run_id: runId, after_sequence: String(after) },
      this.metadata(this.credential),
      { deadline: Date.now() + timeoutSeconds * 1000 },
    );
    // Errors reach the loop below; the one a cancelled call raises is expected.
    call.on('error', () => {});
    try {
      for await (const item of call) {
        const event = item.event;
        after = Math.max(after, Number(event.sequence));
        if (this.show(event) && (await this.stopsHere(event))) break;
      }
    } catch (err) {
      if (err instanceof Failure) throw err;
      throw new Failure(`watching run ${runId}: ${explain(err, this.endpoint, this.principal)}`);
    } finally {
      call.cancel();
    }
    return after;
  }

  /** Whether the run is still in the wait a `waiting` event announced (watched from the
   * start, a resumed run replays its earlier waits too); a terminal event stops. */
  async stopsHere(event) {
    if (event.kind === 'terminal') return true;
    const now = await this.getRun(event.run_id);
    return now.state.startsWith('RUN_STATE_WAITING') && now.ticket?.id === event.waiting.ticket?.id;
  }

  /** Prints one line for a progress event; true for a waiting or terminal one. */
  show(event) {
    const pad = (s) => s.padEnd(10);
    switch (event.kind) {
      case 'started':
        console.log(`  ${pad('started')} run ${event.started.run_id}`);
        return false;
      case 'dispatched': {
        const d = event.dispatched;
        if (!this.names.has(d.delegation_id)) this.names.set(d.delegation_id, d.name);
        console.log(`  ${pad(d.name)} dispatched to ${d.worker_id} (attempt ${d.attempt})`);
        return false;
      }
      case 'completed': {
        const c = event.completed;
        const status = c.status.replace(/^TASK_STATUS_/, '');
        const name = this.names.get(c.delegation_id) || c.name;
        console.log(`  ${pad(name)} ${status}${c.late ? ' (late)' : ''}: ${c.summary}`);
        return false;
      }
      case 'decision':
        console.log(
          `  ${pad('join')} revision ${event.decision.revision}: ${event.decision.outcome}`,
        );
        return false;
      case 'planned':
        console.log(`  ${pad('planner')} round ${event.planned.round}, turn ${event.planned.turn}`);
        return false;
      case 'resumed': {
        const r = event.resumed;
        console.log(`  ${pad('resumed')} ${r.input} by ${r.by}${r.detail ? `: ${r.detail}` : ''}`);
        return false;
      }
      case 'waiting':
        console.log(`  ${pad('waiting')} ${event.waiting.state}: ${event.waiting.reason}`);
        return true;
      case 'terminal':
        console.log(`  ${pad('ended')} ${event.terminal.state}: ${event.terminal.reason}`);
        return true;
      default:
        return false;
    }
  }
}

function printDecision(run, names) {
  const d = run.decision || { revision: 0, outcome: 'none yet', reasons: [], conflicts: [] };
  console.log(`\nDecision (revision ${d.revision}): ${d.outcome}`);
  for (const reason of d.reasons) console.log(`  - ${reason}`);
  for (const conflict of d.conflicts) {
    console.log(`Conflict on ${conflict.topic}: ${conflict.resolution}`);
    for (const claim of conflict.claims) {
      const name = names.get(claim.delegation_id) || claim.delegation_id;
      console.log(
        `  ${name} says ${claim.value}: ${claim.statement} (evidence ${claim.evidence_refs.join(', ')})`,
      );
    }
  }
}

/** Settles the run's first open conflict by choosing the side of delegation `choose` (a
 * name or an id), under the run's current ticket, as `convene runs resolve` does. */
async function settle(s, run, choose, rationale) {
  const open = run.decision.conflicts.filter((c) => c.resolution !== 'CONFLICT_RESOLUTION_SETTLED');
  if (open.length === 0) {
    throw new Failure(`run ${run.run_id} waits for input but has no open conflict to settle`);
  }
  const conflict = open[0];
  const sides = conflict.claims.map((c) => c.delegation_id);
  const chosen = sides.find((id) => id === choose || s.names.get(id) === choose);
  if (!chosen) {
    const choices = sides.map((id) => `${s.names.get(id) || id} (${id})`).join(', ');
    throw new Failure(
      `no side of the conflict on ${conflict.topic} is "${choose}"; pass --choose with one of: ${choices}`,
    );
  }
  console.log(
    `\nSettling ${conflict.topic}: choosing ${choose} (${chosen}) as ${s.principal}, ` +
      `under the run's current ticket ${run.ticket.id} (wait ${run.ticket.version})`,
  );
  const resp = await s.call(s.supervisor, 'ResumeRun', {
    run_id: run.run_id,
    ticket: run.ticket,
    rationale,
    settle: { topic: conflict.topic, delegation_id: chosen },
  });
  console.log(`ResumeRun: ${resp.outcome}`);
}

/** Approves each pending approval request of the run as every approver, each vote bound
 * to the parameters hash the listing shows, then executes it as the first. */
async function approveAndExecute(s, run, approvers) {
  const listed = await s.call(s.approval, 'ListApprovals', {
    run_id: run.run_id,
    states: ['APPROVAL_STATE_PENDING'],
  });
  if (listed.approvals.length === 0) {
    throw new Failure(`run ${run.run_id} waits for approval but has no pending request`);
  }
  const creds = new Map(approvers.map((p) => [p, readCredential(s.dataDir, p)]));
  for (const request of listed.approvals) {
    console.log(
      `\nApproval request ${request.approval_id}: ${request.action}, ${request.risk_level}, ` +
        `${request.approvals_required} approval(s) required\n  parameters hash ${request.parameters_hash}`,
    );
    for (const approver of approvers) {
      const { approval } = await s.call(
        s.approval,
        'Decide',
        {
          approval_id: request.approval_id,
          decision: 'VOTE_DECISION_APPROVE',
          parameters_hash: request.parameters_hash,
          comment: 'rollback reviewed',
        },
        approver,
        creds.get(approver),
      );
      console.log(
        `  approved as ${approver}: ${approval.state} (${approval.votes.length} vote(s))`,
      );
    }
    const executor = approvers[0];
    const done = await s.call(
      s.approval,
      'Execute',
      { approval_id: request.approval_id, parameters_hash: request.parameters_hash },
      executor,
      creds.get(executor),
    );
    const rec = done.execution;
    console.log(
      `  ${done.executed_now ? 'executed now' : 'already executed'} by ${rec.executed_by} ` +
        `with executor ${rec.executor} (success: ${rec.success ? 'True' : 'False'})`,
    );
  }
}

async function main() {
  const opts = options();
  const spec = loadSpec(opts.spec, opts['idempotency-key']);
  const s = new Session(opts.endpoint, opts['data-dir']);
  const started = await s.call(s.supervisor, 'StartRun', { spec });
  let run = started.run;
  for (const d of run.delegations) s.names.set(d.task.delegation_id, d.task.name);
  const verb = started.created ? 'accepted' : 'already exists for this idempotency key;';
  console.log(
    `Run ${run.run_id} ${verb} as ${s.principal}: ${run.delegations.length} delegation(s), ` +
      `trace ${run.trace_id}`,
  );
  let after = 0;
  // Each stop is a wait for people or the end; a few rounds suffice for this incident.
  for (let round = 0; round < 6; round++) {
    after = await s.follow(run.run_id, after, opts.timeout);
    run = await s.getRun(run.run_id);
    if (FINAL.has(run.state)) break;
    if (run.state === 'RUN_STATE_WAITING_INPUT') {
      printDecision(run, s.names);
      await settle(s, run, opts.choose, opts.rationale);
    } else if (run.state === 'RUN_STATE_WAITING_APPROVAL') {
      await approveAndExecute(s, run, opts.approvers.split(','));
    } else {
      throw new Failure(
        `run ${run.run_id} stopped in ${run.state}, which this program does not handle`,
      );
    }
  }
  printDecision(run, s.names);
  console.log(`\nFinal state: ${run.state}`);
  for (const a of run.actions) {
    console.log(
      `Action ${a.action}: ${a.state}, approved by ${a.decided_by.join(', ')}; ` +
        `executed by ${a.execution ? a.execution.executed_by : ''}`,
    );
  }
  if (run.state !== 'RUN_STATE_SUCCEEDED') {
    throw new Failure(
      `run ${run.run_id} ended ${run.state}, not SUCCEEDED: ${run.terminal_reason}`,
    );
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    console.error(`payment_incident.js: ${err instanceof Failure ? err.message : err.stack}`);
    process.exit(1);
  },
);
