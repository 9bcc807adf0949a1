//! `convene evidence verify`: every accepted claim of a run down to its artifacts' bytes.

use anyhow::Context as _;
use convene_proto::v1::{self, evidence_store_server::EvidenceStore as _};

use super::print_json;
use crate::client::Client;

/// `convene evidence verify RUN`: walks every accepted claim of the run down to its
/// artifacts' bytes.
pub async fn evidence_verify(client: &Client, run_id: &str, json: bool) -> anyhow::Result<bool> {
    let run = client
        .supervisor()?
        .get_run(client.request(v1::GetRunRequest {
            run_id: run_id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("the supervisor returned no run")?;
    let claims: Vec<v1::ChainClaim> = run
        .delegations
        .iter()
        .filter_map(|d| d.result.as_ref())
        .flat_map(|r| &r.claims)
        .map(|c| v1::ChainClaim {
            claim_id: c.claim_id.clone(),
            evidence_refs: c.evidence_refs.clone(),
        })
        .collect();
    let resp = client
        .evidence()?
        .verify_chain(client.request(v1::VerifyChainRequest {
            claims,
            rehash_content: true,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        print_json(&resp)?;
        return Ok(resp.intact);
    }
    let asked_by = model_turns(client, &run, &resp.links).await?;
    for link in &resp.links {
        let status = v1::LinkStatus::try_from(link.status)
            .map_or("?", |s| s.as_str_name().trim_start_matches("LINK_STATUS_"));
        let mark = if link.status == v1::LinkStatus::Ok as i32 {
            "ok "
        } else {
            "BAD"
        };
        println!(
            "{mark} {:<22} → {} → {} {status} {}",
            link.claim_id, link.evidence_id, link.artifact_uri, link.detail
        );
        if let Some((call, turn)) = asked_by.get(&link.evidence_id) {
            println!(
                "    {:<22}   recorded by tool call {call}, asked for by model turn {turn}",
                ""
            );
        }
    }
    println!(
        "{} link(s) checked for run {}: {}",
        resp.links.len(),
        run.run_id,
        if resp.intact {
            "every claim's evidence chain is intact (artifacts re-hashed)"
        } else {
            "BROKEN links found"
        }
    );
    Ok(resp.intact)
}

/// For each evidence id among `links`, the tool call that recorded it and the model turn
/// (`model_turn` evidence) that asked for that call, for delegations run by a model.
///
/// A delegation's turns are found without a search: their ids follow from the run, the
/// delegation, its last dispatch attempt and the result's iteration count, and each
/// turn's artifact lists the tool calls it asked for.
async fn model_turns(
    client: &Client,
    run: &v1::Run,
    links: &[v1::ChainLink],
) -> anyhow::Result<std::collections::HashMap<String, (String, String)>> {
    use std::collections::HashMap;
    let evidence = client.evidence()?;
    let mut turn_ids = Vec::new();
    for d in &run.delegations {
        let (Some(task), Some(result)) = (&d.task, &d.result) else {
            continue;
        };
        let turns = result.usage.as_ref().map_or(0, |u| u.iterations);
        for turn in 1..=turns {
            turn_ids.push(convene_worker::agent::turns::turn_evidence_id(
                &task.run_id,
                &task.delegation_id,
                d.attempts.max(1),
                turn,
            ));
        }
    }
    let mut wanted: Vec<String> = links.iter().map(|l| l.evidence_id.clone()).collect();
    wanted.sort();
    wanted.dedup();
    wanted.extend(turn_ids);
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let found = evidence
        .get_evidence(client.request(v1::GetEvidenceRequest {
            evidence_ids: wanted,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .evidence;
    // tool call id (`<delegation>/<call>`) → the turn that asked for it.
    let mut turn_of_call: HashMap<String, String> = HashMap::new();
    for turn in found
        .iter()
        .filter(|e| e.kind == convene_worker::agent::turns::MODEL_TURN_KIND)
    {
        let artifact = evidence
            .get_artifact(client.request(v1::GetArtifactRequest {
                uri: turn.artifact_uri.clone(),
            }))
            .await
            .map_err(|s| client.explain(&s))?
            .into_inner();
        let Ok(body) = serde_json::from_slice::<serde_json::Value>(&artifact.content) else {
            continue;
        };
        let delegation = body["delegation_id"].as_str().unwrap_or_default();
        for call in body["tool_call_ids"].as_array().into_iter().flatten() {
            if let Some(call) = call.as_str() {
                turn_of_call.insert(format!("{delegation}/{call}"), turn.evidence_id.clone());
            }
        }
    }
    Ok(found
        .iter()
        .filter_map(|e| {
            let turn = turn_of_call.get(&e.tool_call_id)?;
            Some((
                e.evidence_id.clone(),
                (e.tool_call_id.clone(), turn.clone()),
            ))
        })
        .collect())
}
