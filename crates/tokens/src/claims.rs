//! The claims a task token carries, and their conversion to and from
//! [`PermissionSet`].
//!
//! Times are whole unix seconds, as JWT requires. Scope time windows are whole seconds as
//! well; converting a [`Permission`] whose window has sub-second bounds narrows it (start
//! rounded up, end rounded down), because a token must never allow more than the policy
//! computed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::permissions::{DataConstraints, Pattern, Permission, PermissionSet, TimeWindow};
use serde::{Deserialize, Serialize};

use crate::TokenError;

/// The claims of a task token. Field names on the wire are the short JWT names in
/// brackets; times are unix seconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Who issued it (`iss`), e.g. `convene-policy`.
    #[serde(rename = "iss")]
    pub issuer: String,
    /// The principal the work is done for (`sub`).
    #[serde(rename = "sub")]
    pub subject: String,
    /// Who may present it (`aud`), e.g. `worker:logs-investigator`.
    #[serde(rename = "aud")]
    pub audience: Vec<String>,
    /// When it was issued (`iat`).
    #[serde(rename = "iat")]
    pub issued_at: u64,
    /// First second it is valid (`nbf`).
    #[serde(rename = "nbf")]
    pub not_before: u64,
    /// First second it is no longer valid (`exp`).
    #[serde(rename = "exp")]
    pub expires_at: u64,
    /// The token's id (`jti`), a UUIDv7; revocation names it.
    #[serde(rename = "jti")]
    pub token_id: String,
    /// The tenant everything it touches must belong to (`tenant`).
    pub tenant: String,
    /// The run it is bound to (`run`).
    #[serde(rename = "run")]
    pub run_id: String,
    /// The delegation it is bound to (`del`).
    #[serde(rename = "del")]
    pub delegation_id: String,
    /// The worker profile holding it (`prof`).
    #[serde(rename = "prof")]
    pub profile_id: String,
    /// Nesting depth of its delegation, 1 at the top level (`depth`).
    pub depth: u32,
    /// The effective permissions (`scp`).
    #[serde(rename = "scp")]
    pub scopes: Vec<Scope>,
    /// The tools it allows, `name@version` (`tools`).
    pub tools: Vec<String>,
    /// Authorized tool calls it allows (`max_calls`).
    pub max_calls: u32,
    /// Whether the holder may ask for child tokens (`redeleg`).
    #[serde(rename = "redeleg")]
    pub may_redelegate: bool,
    /// The `jti` of the token it was derived from, for nested delegation (`parent`).
    #[serde(rename = "parent", default, skip_serializing_if = "Option::is_none")]
    pub parent_token_id: Option<String>,
    /// The run's lease epoch under the supervisor replica it was issued to (`lease`);
    /// 0, and left out, when the supervisor leases no runs. A token whose epoch is below
    /// its run's lease fence was issued to a replica that lost the run: it is refused.
    #[serde(rename = "lease", default, skip_serializing_if = "is_zero")]
    pub lease_epoch: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Claims {
    /// The scopes as a permission set (normalized, so equal sets compare equal).
    ///
    /// A verified token only carries scopes the policy service wrote, so an invalid one
    /// means the token is not one of ours: it is reported as [`TokenError::Malformed`].
    pub fn permissions(&self) -> Result<PermissionSet, TokenError> {
        let perms = self
            .scopes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.to_permission()
                    .map_err(|m| TokenError::malformed(format!("scp[{i}]: {m}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PermissionSet::from_permissions(perms))
    }

    /// Replaces the scopes with `set`, narrowing sub-second windows (see
    /// [`Scope::from_permission`]).
    pub fn set_permissions(&mut self, set: &PermissionSet) {
        self.scopes = Scope::from_set(set);
    }

    /// Succeeds when `presenter` is in the audience.
    pub fn check_audience(&self, presenter: &str) -> Result<(), TokenError> {
        if self.audience.iter().any(|a| a == presenter) {
            Ok(())
        } else {
            Err(TokenError::WrongAudience {
                presenter: presenter.to_owned(),
                audience: self.audience.clone(),
            })
        }
    }

    /// `exp` as a `SystemTime` (`None` past what the platform can represent).
    pub fn expiry(&self) -> Option<SystemTime> {
        from_unix_seconds(self.expires_at)
    }
}

/// One permission in compact form: `{"act":..,"res":..,"from":..,"to":..,"rows":..}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    /// Action pattern, e.g. `logs:read` (`act`).
    #[serde(rename = "act")]
    pub action: String,
    /// Resource pattern, e.g. `service/*` (`res`).
    #[serde(rename = "res")]
    pub resource: String,
    /// Inclusive start of the data window, unix seconds (`from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<u64>,
    /// Exclusive end of the data window, unix seconds (`to`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<u64>,
    /// At most this many rows per call (`rows`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
}

impl Scope {
    /// The compact form of `p`, or `None` when nothing of it survives narrowing to whole
    /// seconds.
    ///
    /// The window's start is rounded up and its end rounded down, so the scope never
    /// allows data the permission did not; a start before 1970 becomes 1970. A window
    /// that holds no whole second afterwards (e.g. `[10.2 s, 10.8 s)`) allows nothing a
    /// token can express, so the permission is left out rather than widened.
    pub fn from_permission(p: &Permission) -> Option<Scope> {
        let from = p.data.time.start.map(ceil_unix_seconds);
        let to = match p.data.time.end {
            None => None,
            Some(end) => Some(floor_unix_seconds(end)?),
        };
        if let (Some(f), Some(t)) = (from, to)
            && f >= t
        {
            return None;
        }
        Some(Scope {
            action: p.action.to_string(),
            resource: p.resource.to_string(),
            from,
            to,
            rows: p.data.max_rows,
        })
    }

    /// The compact forms of every permission of `set`, in the set's order (see
    /// [`Scope::from_permission`] for what is narrowed).
    pub fn from_set(set: &PermissionSet) -> Vec<Scope> {
        set.permissions()
            .iter()
            .filter_map(Scope::from_permission)
            .collect()
    }

    /// The permission this scope stands for, or why it is invalid.
    pub fn to_permission(&self) -> Result<Permission, String> {
        let action = Pattern::parse(&self.action).map_err(|m| format!("act: {m}"))?;
        let resource = Pattern::parse(&self.resource).map_err(|m| format!("res: {m}"))?;
        let start = self
            .from
            .map(|s| from_unix_seconds(s).ok_or_else(|| format!("from: {s} is out of range")))
            .transpose()?;
        let end = self
            .to
            .map(|s| from_unix_seconds(s).ok_or_else(|| format!("to: {s} is out of range")))
            .transpose()?;
        let time = TimeWindow { start, end };
        if time.is_empty() {
            return Err("from must be before to".to_owned());
        }
        Ok(Permission {
            action,
            resource,
            data: DataConstraints {
                time,
                max_rows: self.rows,
            },
        })
    }
}

/// Whole unix seconds of `t`, rounded down; 0 before 1970.
///
/// This is how `iat`, `nbf` and `exp` are meant to be computed: rounding `exp` down never
/// lengthens a token's life.
pub fn unix_seconds(t: SystemTime) -> u64 {
    floor_unix_seconds(t).unwrap_or(0)
}

/// The instant `secs` unix seconds stand for (`None` past what the platform represents).
pub fn from_unix_seconds(secs: u64) -> Option<SystemTime> {
    UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

/// A fresh token id: a UUIDv7, so ids sort by issue time in the decision log.
pub fn new_token_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

fn floor_unix_seconds(t: SystemTime) -> Option<u64> {
    t.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs())
}

fn ceil_unix_seconds(t: SystemTime) -> u64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0)),
        Err(_) => 0,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    fn perm(action: &str, resource: &str, data: DataConstraints) -> Permission {
        Permission::new(action, resource).unwrap().with_data(data)
    }

    fn pattern() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("*".to_owned()),
            "[a-c]{1,3}(:[a-c]{1,2})?\\*?",
            "service/[a-c]{0,3}\\*?",
        ]
    }

    fn whole_second_permission() -> impl Strategy<Value = Permission> {
        (
            pattern(),
            pattern(),
            proptest::option::of(0u64..4_000_000_000),
            proptest::option::of(1u64..100_000),
            proptest::option::of(0u64..1_000),
        )
            .prop_map(|(a, r, start, len, rows)| {
                let start_t = start.map(|s| at(s, 0));
                let end_t = len.map(|l| at(start.unwrap_or(0) + l, 0));
                perm(
                    &a,
                    &r,
                    DataConstraints {
                        time: TimeWindow {
                            start: start_t,
                            end: end_t,
                        },
                        max_rows: rows,
                    },
                )
            })
    }

    proptest! {
        #[test]
        fn whole_second_sets_round_trip_exactly(
            perms in proptest::collection::vec(whole_second_permission(), 0..6)
        ) {
            let set = PermissionSet::from_permissions(perms);
            let scopes = Scope::from_set(&set);
            prop_assert_eq!(scopes.len(), set.permissions().len());
            let claims = Claims { scopes, ..sample() };
            prop_assert_eq!(claims.permissions().unwrap(), set);
        }

        #[test]
        fn sub_second_windows_only_narrow(
            start in 0u64..1_000_000, start_ns in 0u32..1_000_000_000,
            len_ns in 0u64..5_000_000_000, rows in proptest::option::of(0u64..10),
        ) {
            let s = at(start, start_ns);
            let window = TimeWindow { start: Some(s), end: Some(s + Duration::from_nanos(len_ns)) };
            let p = perm("logs:read", "service/*", DataConstraints { time: window, max_rows: rows });
            match Scope::from_permission(&p) {
                Some(scope) => {
                    let back = scope.to_permission().unwrap();
                    prop_assert!(p.covers(&back), "{:?} widened {:?}", back, p);
                    // Narrowing drops less than a second at each end.
                    let (bs, be) = (back.data.time.start.unwrap(), back.data.time.end.unwrap());
                    prop_assert!(bs.duration_since(s).unwrap() < Duration::from_secs(1));
                    prop_assert!(window.end.unwrap().duration_since(be).unwrap() < Duration::from_secs(1));
                }
                None => {
                    // Dropped only when no whole second fits inside the window.
                    prop_assert!(ceil_unix_seconds(s) >= floor_unix_seconds(window.end.unwrap()).unwrap());
                }
            }
        }
    }

    pub(crate) fn sample() -> Claims {
        Claims {
            issuer: "convene-policy".into(),
            subject: "user:alice".into(),
            audience: vec![
                "worker:logs-investigator".into(),
                "convene-evidence-store".into(),
            ],
            issued_at: 1_800_000_000,
            not_before: 1_800_000_000,
            expires_at: 1_800_000_900,
            token_id: new_token_id(),
            tenant: "acme".into(),
            run_id: "run-1".into(),
            delegation_id: "del-1".into(),
            profile_id: "logs-investigator".into(),
            depth: 1,
            scopes: Vec::new(),
            tools: vec!["search_logs@1".into()],
            max_calls: 32,
            may_redelegate: false,
            parent_token_id: None,
            lease_epoch: 0,
        }
    }

    #[test]
    fn compact_json_uses_short_names_and_omits_unset_bounds() {
        let mut claims = sample();
        claims.set_permissions(&PermissionSet::from_permissions([perm(
            "logs:read",
            "service/*",
            DataConstraints {
                time: TimeWindow {
                    start: Some(at(100, 0)),
                    end: None,
                },
                max_rows: None,
            },
        )]));
        let json = serde_json::to_value(&claims).unwrap();
        assert_eq!(
            json["scp"],
            serde_json::json!([{"act": "logs:read", "res": "service/*", "from": 100}])
        );
        assert!(json.get("parent").is_none());
        assert_eq!(json["redeleg"], false);
        assert_eq!(json["exp"], 1_800_000_900);
    }

    #[test]
    fn window_rounds_inward() {
        let p = perm(
            "logs:read",
            "*",
            DataConstraints {
                time: TimeWindow {
                    start: Some(at(10, 1)),
                    end: Some(at(20, 999_999_999)),
                },
                max_rows: None,
            },
        );
        let s = Scope::from_permission(&p).unwrap();
        assert_eq!((s.from, s.to), (Some(11), Some(20)));
        let tiny = perm(
            "logs:read",
            "*",
            DataConstraints {
                time: TimeWindow {
                    start: Some(at(10, 200)),
                    end: Some(at(10, 800)),
                },
                max_rows: None,
            },
        );
        assert_eq!(Scope::from_permission(&tiny), None);
    }

    #[test]
    fn invalid_scopes_are_malformed_and_name_the_index() {
        let mut claims = sample();
        claims.scopes = vec![
            Scope {
                action: "logs:read".into(),
                resource: "*".into(),
                from: None,
                to: None,
                rows: None,
            },
            Scope {
                action: "lo*gs".into(),
                resource: "*".into(),
                from: None,
                to: None,
                rows: None,
            },
        ];
        let err = claims.permissions().unwrap_err();
        assert!(
            matches!(&err, TokenError::Malformed { detail } if detail.starts_with("scp[1]: act:")),
            "{err}"
        );
        claims.scopes[1] = Scope {
            action: "logs:read".into(),
            resource: "x".into(),
            from: Some(5),
            to: Some(5),
            rows: None,
        };
        assert!(claims.permissions().is_err());
    }

    #[test]
    fn audience_check() {
        let claims = sample();
        assert_eq!(claims.check_audience("convene-evidence-store"), Ok(()));
        let err = claims.check_audience("worker:metrics").unwrap_err();
        assert_eq!(
            err.reason(),
            convene_proto::v1::AuthorizeReason::WrongAudience
        );
        assert!(err.to_string().contains("worker:logs-investigator"));
        // Matching is exact: a prefix of an audience entry is not that entry.
        assert!(claims.check_audience("worker:logs").is_err());
    }

    #[test]
    fn unix_seconds_round_down_and_clamp() {
        assert_eq!(unix_seconds(at(5, 999_999_999)), 5);
        assert_eq!(unix_seconds(UNIX_EPOCH - Duration::from_secs(3)), 0);
        assert_eq!(from_unix_seconds(5), Some(at(5, 0)));
    }
}
