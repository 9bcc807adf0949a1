//! `convene evidence verify`: every accepted claim of a run down to its artifacts' bytes.

use convene_proto::v1::{self, evidence_store_server::EvidenceStore as _};

use convene_core::turns::{
    ChainBreak, Conversation, MODEL_TURN_KIND, StoredTurn, chain_ids, walk_found,
};

use crate::client::Client;

/// `convene evidence verify RUN`: walks every accepted claim of the run down to its
/// artifacts' bytes.
pub async fn evidence_verify(client: &Client, run_id: &str, json: bool) -> anyhow::Result<bool> {
    let run = super::get_run(client, run_id).await?;
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
    let turns = model_turns(client, &run, &resp.links).await?;
    let chains_intact = turns.chains.iter().all(|c| c.walked.is_ok());
    let intact = resp.intact && chains_intact;
    if json {
        let mut value = convene_proto::json::to_value(&resp)?;
        value["intact"] = serde_json::json!(intact);
        value["conversations"] = turns
            .chains
            .iter()
            .map(|c| match &c.walked {
                Ok(conversation) => serde_json::json!({
                    "delegationId": c.delegation_id,
                    "attempt": c.attempt,
                    "turns": conversation.turns,
                    "messages": conversation.messages.len(),
                    "intact": true,
                }),
                Err(broken) => serde_json::json!({
                    "delegationId": c.delegation_id,
                    "attempt": c.attempt,
                    "intact": false,
                    "brokenAt": broken.turn,
                    "detail": broken.to_string(),
                }),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(intact);
    }
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
        if let Some((call, turn)) = turns.asked_by.get(&link.evidence_id) {
            println!(
                "    {:<22}   recorded by tool call {call}, asked for by model turn {turn}",
                ""
            );
        }
    }
    for chain in &turns.chains {
        match &chain.walked {
            Ok(conversation) => println!(
                "ok  conversation of {} (attempt {}): {} turn(s), {} message(s), each turn \
                 chained to the one before",
                chain.delegation_id,
                chain.attempt,
                conversation.turns,
                conversation.messages.len()
            ),
            Err(broken) => println!(
                "BAD conversation of {} (attempt {}): the chain breaks at {broken}",
                chain.delegation_id, chain.attempt
            ),
        }
    }
    println!(
        "{} link(s) and {} conversation(s) checked for run {}: {}",
        resp.links.len(),
        turns.chains.len(),
        run.run_id,
        if intact {
            "every claim's evidence chain and every model conversation is intact (artifacts re-hashed)"
        } else {
            "BROKEN links found"
        }
    );
    Ok(intact)
}

/// What a run's model turns say: which turn asked for each tool call, and each
/// delegation's conversation walked from its turns.
struct Turns {
    /// Evidence id → (the tool call that recorded it, the turn that asked for that call).
    asked_by: std::collections::HashMap<String, (String, String)>,
    /// One per delegation run by a model that records its turns.
    chains: Vec<Chain>,
}

/// One delegation's conversation, walked.
struct Chain {
    delegation_id: String,
    attempt: u32,
    walked: Result<Conversation, ChainBreak>,
}

/// For each evidence id among `links`, the tool call that recorded it and the model turn
/// (`model_turn` evidence) that asked for that call; and each model delegation's
/// conversation, rebuilt by walking its chain of turns.
///
/// A delegation's turns are found without a search: their ids follow from the run, the
/// delegation, its last dispatch attempt and the result's iteration count, and each
/// turn's artifact lists the tool calls it asked for. A delegation none of whose turns
/// is stored has a provider that stores none (a playbook) and no conversation.
async fn model_turns(
    client: &Client,
    run: &v1::Run,
    links: &[v1::ChainLink],
) -> anyhow::Result<Turns> {
    use std::collections::HashMap;
    let evidence = client.evidence()?;
    // (delegation, attempt, the ids of its turns in order)
    let mut delegations: Vec<(String, u32, Vec<String>)> = Vec::new();
    for d in &run.delegations {
        let (Some(task), Some(result)) = (&d.task, &d.result) else {
            continue;
        };
        let turns = result.usage.as_ref().map_or(0, |u| u.iterations);
        let attempt = d.attempts.max(1);
        let ids = chain_ids(&task.run_id, &task.delegation_id, attempt, turns);
        delegations.push((task.delegation_id.clone(), attempt, ids));
    }
    let mut wanted: Vec<String> = links.iter().map(|l| l.evidence_id.clone()).collect();
    wanted.sort();
    wanted.dedup();
    wanted.extend(
        delegations
            .iter()
            .flat_map(|(_, _, ids)| ids.iter().cloned()),
    );
    if wanted.is_empty() {
        return Ok(Turns {
            asked_by: HashMap::new(),
            chains: Vec::new(),
        });
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
    let mut stored: HashMap<String, StoredTurn> = HashMap::new();
    for turn in found.iter().filter(|e| e.kind == MODEL_TURN_KIND) {
        let artifact = evidence
            .get_artifact(client.request(v1::GetArtifactRequest {
                uri: turn.artifact_uri.clone(),
            }))
            .await
            .map_err(|s| client.explain(&s))?
            .into_inner();
        if let Ok(body) = serde_json::from_slice::<serde_json::Value>(&artifact.content) {
            // The record's tool call id is `<delegation>/turn-<n>`.
            let delegation = turn
                .tool_call_id
                .rsplit_once("/turn-")
                .map_or("", |(delegation, _)| delegation);
            let calls = body["response"]["message"]["tool_calls"].as_array();
            for call in calls.into_iter().flatten() {
                if let Some(call) = call["id"].as_str() {
                    turn_of_call.insert(format!("{delegation}/{call}"), turn.evidence_id.clone());
                }
            }
        }
        stored.insert(
            turn.evidence_id.clone(),
            StoredTurn {
                evidence_id: turn.evidence_id.clone(),
                content_hash: turn.content_hash.clone(),
                bytes: artifact.content,
            },
        );
    }
    let chains = delegations
        .into_iter()
        .filter(|(_, _, ids)| ids.iter().any(|id| stored.contains_key(id)))
        .map(|(delegation_id, attempt, ids)| {
            let walked = walk_found(&ids, &stored);
            Chain {
                delegation_id,
                attempt,
                walked,
            }
        })
        .collect();
    let asked_by = found
        .iter()
        .filter_map(|e| {
            let turn = turn_of_call.get(&e.tool_call_id)?;
            Some((
                e.evidence_id.clone(),
                (e.tool_call_id.clone(), turn.clone()),
            ))
        })
        .collect();
    Ok(Turns { asked_by, chains })
}

/// `convene runs get RUN --conversation DELEGATION`: the delegation's conversation with
/// its model, rebuilt by walking its chain of stored turns.
pub async fn print_conversation(
    client: &Client,
    run: &v1::Run,
    delegation_id: &str,
    json: bool,
) -> anyhow::Result<()> {
    let Some(delegation) = run.delegations.iter().find(|d| {
        d.task
            .as_ref()
            .is_some_and(|t| t.delegation_id == delegation_id)
    }) else {
        let ids: Vec<&str> = run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.as_str()))
            .collect();
        anyhow::bail!(
            "run {} has no delegation {delegation_id}; its delegations: {}",
            run.run_id,
            if ids.is_empty() {
                "none".to_owned()
            } else {
                ids.join(", ")
            }
        );
    };
    let one = v1::Run {
        delegations: vec![delegation.clone()],
        ..run.clone()
    };
    let turns = model_turns(client, &one, &[]).await?;
    let Some(chain) = turns.chains.into_iter().next() else {
        anyhow::bail!(
            "delegation {delegation_id} has no stored model turns: it has no result yet, or \
             its provider stores none (a playbook, a remote agent)"
        );
    };
    let conversation = chain.walked.map_err(|broken| {
        anyhow::anyhow!(
            "the conversation of {delegation_id} cannot be rebuilt: its chain breaks at \
             {broken}; `convene evidence verify {}` checks the whole run",
            run.run_id
        )
    })?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "delegationId": delegation_id,
                "attempt": chain.attempt,
                "turns": conversation.turns,
                "system": conversation.system,
                "tools": conversation.tools,
                "messages": conversation.messages,
            }))?
        );
        return Ok(());
    }
    println!(
        "conversation of {delegation_id} (attempt {}): {} turn(s), tools {}",
        chain.attempt,
        conversation.turns,
        conversation.tools.join(", ")
    );
    for m in &conversation.messages {
        let role = m["role"].as_str().unwrap_or("?");
        let content = m["content"].as_str().unwrap_or_default();
        if !content.is_empty() {
            println!("[{role}] {content}");
        }
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            println!(
                "[{role}] calls {} {}",
                call["name"].as_str().unwrap_or("?"),
                call["arguments"]
            );
        }
    }
    Ok(())
}
