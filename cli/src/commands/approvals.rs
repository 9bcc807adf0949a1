//! `convene approvals`: list requests, vote and execute, bound to the hash the
//! approver saw.

use std::io::IsTerminal as _;

use anyhow::Context as _;
use convene_proto::v1::{self, approval_server::Approval as _};

use super::print_json;
use crate::client::Client;
use crate::report;
use convene_mesh::handles::GrpcApproval;

/// `convene approvals list`.
pub async fn approvals_list(
    client: &Client,
    run_id: Option<String>,
    states: Vec<i32>,
    json: bool,
) -> anyhow::Result<()> {
    let resp = client
        .approval()?
        .list_approvals(client.request(v1::ListApprovalsRequest {
            states,
            run_id: run_id.unwrap_or_default(),
            page_size: 100,
            page_token: String::new(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        return print_json(&resp);
    }
    if resp.approvals.is_empty() {
        println!("No approval requests.");
    }
    for (i, a) in resp.approvals.iter().enumerate() {
        if i > 0 {
            println!();
        }
        print!("{}", report::approval(a));
    }
    Ok(())
}

/// What an approval command does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalVerb {
    /// Vote to approve.
    Approve,
    /// Vote to reject.
    Reject,
    /// Execute the approved action.
    Execute,
}

impl ApprovalVerb {
    fn word(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject => "reject",
            Self::Execute => "execute",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Self::Approve => "approved",
            Self::Reject => "rejected",
            Self::Execute => "executed",
        }
    }
}

/// A parameters hash as the approval service writes it, `sha256:<64 lowercase hex>`,
/// from `given` with or without the `sha256:` prefix.
///
/// # Errors
///
/// When `given` is not 64 hex digits after the optional prefix.
fn normalize_hash(given: &str) -> anyhow::Result<String> {
    let trimmed = given.trim();
    let hex = match trimmed.get(..7) {
        Some(prefix) if prefix.eq_ignore_ascii_case("sha256:") => &trimmed[7..],
        _ => trimmed,
    };
    anyhow::ensure!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "--hash {given:?} is not a parameters hash: pass sha256:<64 hex digits> (the prefix \
         may be left out) as `convene approvals list` shows it"
    );
    Ok(format!("sha256:{}", hex.to_ascii_lowercase()))
}

/// The hash the person vouches for on `request`: `given` when it is the request's;
/// without it, the request's own once they confirmed it on a terminal.
///
/// # Errors
///
/// When `given` is not the request's hash (the parameters are not what they reviewed),
/// when there is no terminal to confirm on, or when they did not answer yes.
async fn vouched_hash(
    request: &v1::ApprovalRequest,
    given: Option<&str>,
    verb: ApprovalVerb,
) -> anyhow::Result<String> {
    let id = &request.approval_id;
    let list = if request.run_id.is_empty() {
        "convene approvals list".to_owned()
    } else {
        format!("convene approvals list --run {}", request.run_id)
    };
    if let Some(given) = given {
        let hash = normalize_hash(given)?;
        anyhow::ensure!(
            hash == request.parameters_hash,
            "refusing to {} approval request {id}: you passed --hash {hash}, but the request \
             binds its parameters to {}. They are not the parameters you reviewed: review the \
             request again (`{list}`) and pass the hash it shows. Nothing was recorded.",
            verb.word(),
            request.parameters_hash
        );
        return Ok(hash);
    }
    if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
        anyhow::bail!(
            "refusing to {} approval request {id} without --hash: there is no terminal to \
             confirm on. Review the request (`{list}`) and pass --hash <hash> as shown there; \
             it binds your decision to the parameters you reviewed. Nothing was recorded.",
            verb.word()
        );
    }
    eprint!("{}", report::approval(request));
    eprint!("{}? [y/N] ", verb.word());
    std::io::Write::flush(&mut std::io::stderr())?;
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .context("reading the answer")??;
    let answer = answer.trim();
    if answer.eq_ignore_ascii_case("y") || answer.eq_ignore_ascii_case("yes") {
        Ok(request.parameters_hash.clone())
    } else {
        anyhow::bail!(
            "not {}: the answer was {answer:?}, not y; nothing was recorded",
            verb.done()
        )
    }
}

/// `convene approvals approve|reject`: votes on the parameters the person reviewed,
/// binding the vote to the hash they passed (`hash`) or confirmed on a terminal.
pub async fn approvals_decide(
    client: &Client,
    id: &str,
    verb: ApprovalVerb,
    hash: Option<&str>,
    comment: &str,
) -> anyhow::Result<v1::ApprovalRequest> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let parameters_hash = vouched_hash(&current, hash, verb).await?;
    let decided = approval
        .decide(client.request(v1::DecideRequest {
            approval_id: id.to_owned(),
            decision: if verb == ApprovalVerb::Reject {
                v1::VoteDecision::Reject
            } else {
                v1::VoteDecision::Approve
            } as i32,
            parameters_hash,
            comment: comment.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .approval
        .context("no approval returned")?;
    let state = v1::ApprovalState::try_from(decided.state).map_or("?", |s| {
        s.as_str_name().trim_start_matches("APPROVAL_STATE_")
    });
    println!(
        "approval {id}: {state} ({} vote(s); {} approval(s) required)",
        decided.votes.len(),
        decided.approvals_required
    );
    Ok(decided)
}

/// `convene approvals execute`: executes the approved parameters the person reviewed
/// (`hash`, or confirmed on a terminal).
pub async fn approvals_execute(
    client: &Client,
    id: &str,
    hash: Option<&str>,
) -> anyhow::Result<v1::ApprovalExecuteResponse> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let parameters_hash = vouched_hash(&current, hash, ApprovalVerb::Execute).await?;
    let resp = approval
        .execute(client.request(v1::ApprovalExecuteRequest {
            approval_id: id.to_owned(),
            parameters_hash,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    let rec = resp.execution.clone().unwrap_or_default();
    println!(
        "approval {id}: {} by {} with executor {} (success: {})",
        if resp.executed_now {
            "executed now"
        } else {
            "already executed"
        },
        rec.executed_by,
        rec.executor,
        rec.success
    );
    Ok(resp)
}

/// Approval `id` as it stands, whose parameter hash a decision or an execution binds to.
async fn current_approval(
    client: &Client,
    approval: &GrpcApproval,
    id: &str,
) -> anyhow::Result<v1::ApprovalRequest> {
    approval
        .get_approval(client.request(v1::GetApprovalRequest {
            approval_id: id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .approval
        .context("no approval returned")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_taken_with_or_without_its_prefix_in_the_service_form() {
        let hex = "AB".repeat(32);
        let want = format!("sha256:{}", "ab".repeat(32));
        for given in [
            hex.clone(),
            format!("sha256:{hex}"),
            format!("SHA256:{hex}"),
            format!("  sha256:{}\n", hex.to_lowercase()),
        ] {
            assert_eq!(normalize_hash(&given).expect(&given), want, "{given:?}");
        }
        for bad in [
            "",
            "sha256:",
            "sha256:abc",
            &format!("md5:{hex}"),
            &"g".repeat(64),
        ] {
            let err = normalize_hash(bad).expect_err(bad).to_string();
            assert!(err.contains("sha256:<64 hex digits>"), "{err}");
        }
    }
}
