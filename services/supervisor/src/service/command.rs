//! Commands for runs (CancelRun, ResumeRun) stored and awaited, and a worker's
//! Delegate forwarded to the replica that runs its run.

use convene_mesh::auth::Caller;
use convene_mesh::policy_file::Principal;
use convene_proto::v1;
use tonic::{Request, Response, Status};

use super::SupervisorService;
use crate::commands;
use crate::error::Error;
use crate::store::CommandKind;

/// Metadata a replica sets on a call it forwards to another, so it is never forwarded
/// again.
const FORWARDED: &str = "x-convene-forwarded";

impl SupervisorService {
    /// Stores a command of `principal` for `run_id`, gets it applied as far as this
    /// replica can, and waits a little for its outcome: the run as it stands then, the
    /// outcome (`None`: still pending) and the command's id.
    pub(super) async fn command(
        &self,
        run_id: &str,
        principal: &Principal,
        kind: CommandKind,
    ) -> Result<(v1::Run, Option<crate::store::CommandDone>, String), Error> {
        let command = commands::command(&self.deps, run_id, &principal.id, kind);
        self.deps.store.add_command(&command).await?;
        commands::nudge(&self.deps, run_id).await?;
        let outcome = commands::outcome(&self.deps, &command.command_id, commands::WAIT).await?;
        let run = self.stored_run(run_id).await?;
        Ok((run, outcome, command.command_id))
    }

    /// Records this replica's endpoint, for the calls other replicas forward to it.
    pub(crate) async fn register(&self, replica: &str, endpoint: &str) -> Result<(), Error> {
        self.deps.store.register_replica(replica, endpoint).await?;
        Ok(())
    }

    /// A worker's Delegate for a run this replica does not run: forwarded, with the
    /// worker's token and the caller's trace, to the replica that holds the run's
    /// lease. Never forwarded twice, nor to this replica.
    pub(super) async fn forward_delegate(
        &self,
        request: Request<v1::DelegateRequest>,
        not_here: Error,
    ) -> Result<Response<v1::DelegateResponse>, Status> {
        let run_id = self
            .auth
            .authenticate(&request)
            .await
            .ok()
            .and_then(|c| match c {
                Caller::Task(claims) => Some(claims.run_id.clone()),
                Caller::Principal(_) => None,
            });
        let Some(run_id) = run_id else {
            return Err(not_here.into());
        };
        let forwarded = request.metadata().contains_key(FORWARDED);
        let me = self.deps.lease.as_ref().map(|l| l.owner.as_str());
        let owner = self
            .deps
            .store
            .run_owner(&run_id)
            .await
            .map_err(Error::from)?;
        let endpoint = match owner {
            Some((owner, Some(endpoint))) if !forwarded && Some(owner.as_str()) != me => endpoint,
            Some((owner, None)) if Some(owner.as_str()) != me => {
                return Err(Error::Unavailable(format!(
                    "run {run_id} is run by supervisor replica {owner}, which recorded no endpoint to forward to (set its advertise_endpoint); retry later"
                ))
                .into());
            }
            _ => return Err(not_here.into()),
        };
        let client = {
            let mut peers = self.peers.lock().expect("peers lock poisoned");
            match peers.get(&endpoint) {
                Some(c) => c.clone(),
                None => {
                    let c =
                        convene_mesh::handles::GrpcSupervisor::connect(&endpoint).map_err(|e| {
                            Error::Unavailable(format!("replica endpoint {endpoint}: {e}"))
                        })?;
                    peers.insert(endpoint.clone(), c.clone());
                    c
                }
            }
        };
        let authorization = request.metadata().get("authorization").cloned();
        let mut onward = Request::new(request.into_inner());
        if let Some(a) = authorization {
            onward.metadata_mut().insert("authorization", a);
        }
        onward
            .metadata_mut()
            .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
        tracing::debug!(%run_id, %endpoint, "forwarding Delegate to the replica that runs the run");
        use convene_proto::v1::supervisor_server::Supervisor as _;
        client.delegate(onward).await
    }
}

/// Checks what a ResumeRun carries before it is stored: a ticket, a rationale and one
/// well-formed input.
pub(super) fn check_resume(req: &v1::ResumeRunRequest) -> Result<(), Error> {
    if req.ticket.as_ref().is_none_or(|t| t.id.trim().is_empty()) {
        return Err(Error::invalid(
            "ticket",
            "required: give the run's current ticket (Run.ticket, or its `waiting` event)",
        ));
    }
    if req.rationale.trim().is_empty() {
        return Err(Error::invalid(
            "rationale",
            "required: say why, for the record",
        ));
    }
    match &req.input {
        None => Err(Error::invalid(
            "input",
            "required: settle a conflict, ask for a follow-up, or close the run",
        )),
        Some(v1::resume_run_request::Input::Settle(s)) => {
            if s.topic.trim().is_empty() {
                return Err(Error::invalid(
                    "settle.topic",
                    "required: the conflict's topic",
                ));
            }
            if s.delegation_id.trim().is_empty() {
                return Err(Error::invalid(
                    "settle.delegation_id",
                    "required: the delegation whose claim is chosen",
                ));
            }
            Ok(())
        }
        Some(v1::resume_run_request::Input::FollowUp(f)) => {
            if f.profile_id.trim().is_empty() {
                return Err(Error::invalid(
                    "follow_up.profile_id",
                    "required: the profile to ask",
                ));
            }
            if f.goal.trim().is_empty() {
                return Err(Error::invalid(
                    "follow_up.goal",
                    "required: what the follow-up must establish",
                ));
            }
            Ok(())
        }
        Some(v1::resume_run_request::Input::Close(_)) => Ok(()),
    }
}
