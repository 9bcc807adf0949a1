//! Reading approval requests: one by id, and pages of a listing whose tokens are bound
//! to the caller and the filters.

use base64::{Engine as _, engine::general_purpose::URL_SAFE_NO_PAD};
use convene_core::{Rule, ids::content_hash, time::to_timestamp};
use convene_mesh::auth::Caller;
use convene_proto::v1;
use tonic::Status;

use super::{ApprovalService, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, invalid, required};
use crate::{
    error::ApprovalError,
    model::{ApprovalRequest, State},
    store::{Cursor, ListQuery, Viewer},
};

impl ApprovalService {
    pub(super) async fn get_inner(
        &self,
        caller: &Caller,
        msg: v1::GetApprovalRequest,
    ) -> Result<ApprovalRequest, Status> {
        let principal = caller.require_principal("read approval requests")?;
        required("approval_id", &msg.approval_id)?;
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        match self
            .store
            .get(&msg.approval_id)
            .await
            .map_err(ApprovalError::from)?
        {
            Some(stored) if viewer.can_see(&stored.request) => Ok(stored.request),
            _ => Err(ApprovalError::NotFound {
                approval_id: msg.approval_id,
            }
            .into()),
        }
    }

    pub(super) async fn list_inner(
        &self,
        caller: &Caller,
        msg: v1::ListApprovalsRequest,
    ) -> Result<(Vec<ApprovalRequest>, String), Status> {
        let principal = caller.require_principal("list approval requests")?;
        let mut states = Vec::with_capacity(msg.states.len());
        for (i, &s) in msg.states.iter().enumerate() {
            let state = State::from_proto(s).ok_or_else(|| {
                invalid(
                    &format!("states[{i}]"),
                    Rule::UnknownEnum,
                    format!("{s} is not a state to filter by; use APPROVAL_STATE_PENDING ... APPROVAL_STATE_CANCELLED"),
                )
            })?;
            if !states.contains(&state) {
                states.push(state);
            }
        }
        let run_id = (!msg.run_id.is_empty()).then_some(msg.run_id);
        let page_size = match usize::try_from(msg.page_size).unwrap_or(MAX_PAGE_SIZE) {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        };
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        let filters = PageFilters {
            viewer: &viewer,
            states: &states,
            run_id: run_id.as_deref(),
        };
        let after = if msg.page_token.is_empty() {
            None
        } else {
            Some(filters.decode(&msg.page_token)?)
        };
        let query = ListQuery {
            viewer: viewer.clone(),
            states: states.clone(),
            run_id: run_id.clone(),
            now: self.clock.now(),
            after,
            // One more than a page tells whether another page follows.
            limit: page_size + 1,
        };
        let mut page: Vec<ApprovalRequest> = self
            .store
            .list(&query)
            .await
            .map_err(ApprovalError::from)?
            .into_iter()
            .map(|stored| stored.request)
            .collect();
        let next_page_token = if page.len() > page_size {
            page.truncate(page_size);
            page.last()
                .map(|last| filters.encode(last))
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok((page, next_page_token))
    }
}

/// The filters a page token is bound to, so a token cannot resume a different listing.
struct PageFilters<'a> {
    viewer: &'a Viewer,
    states: &'a [State],
    run_id: Option<&'a str>,
}

impl PageFilters<'_> {
    const VERSION: &'static str = "p1";

    fn fingerprint(&self) -> String {
        let mut states: Vec<String> = self.states.iter().map(ToString::to_string).collect();
        states.sort();
        let text = format!(
            "{}\0{}\0{}\0{}",
            self.viewer.tenant,
            self.viewer.principal,
            states.join(","),
            self.run_id.unwrap_or("")
        );
        content_hash(text.as_bytes())[7..23].to_owned()
    }

    /// An opaque token resuming after `last`.
    fn encode(&self, last: &ApprovalRequest) -> String {
        let at = to_timestamp(last.created_at);
        let text = format!(
            "{}|{}|{}|{}|{}",
            Self::VERSION,
            self.fingerprint(),
            at.seconds,
            at.nanos,
            last.approval_id
        );
        URL_SAFE_NO_PAD.encode(text)
    }

    fn decode(&self, token: &str) -> Result<Cursor, ApprovalError> {
        const FOREIGN: &str = "it is not a page token this service issued";
        let bytes = URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        let text = String::from_utf8(bytes).map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        let mut parts = text.splitn(5, '|');
        let (Some(version), Some(fingerprint), Some(seconds), Some(nanos), Some(approval_id)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(ApprovalError::PageToken(FOREIGN));
        };
        if version != Self::VERSION {
            return Err(ApprovalError::PageToken(FOREIGN));
        }
        if fingerprint != self.fingerprint() {
            return Err(ApprovalError::PageToken(
                "it was issued for other filters or another caller",
            ));
        }
        let timestamp = prost_types::Timestamp {
            seconds: seconds
                .parse()
                .map_err(|_| ApprovalError::PageToken(FOREIGN))?,
            nanos: nanos
                .parse()
                .map_err(|_| ApprovalError::PageToken(FOREIGN))?,
        };
        let created_at = convene_core::time::from_timestamp(&timestamp, "page_token")
            .map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        Ok(Cursor {
            created_at,
            approval_id: approval_id.to_owned(),
        })
    }
}
