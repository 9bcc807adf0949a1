//! Fault injection, for chaos and end-to-end tests only.
//!
//! A profile's optional `faults` section makes the worker misbehave in one precise way,
//! so tests can prove that the supervisor, the join and the evidence checks catch it:
//! a worker that hangs, is slow, fails transiently (before or after its tool calls),
//! answers for the wrong delegation, cites no or foreign evidence, lies about a hash, or
//! dies mid-task. Never set it in a profile that serves real work; the worker logs a
//! warning for every profile that has one.
//!
//! One section serves benchmarks rather than chaos: `hold` keeps every delegation
//! waiting until a release file appears, so a load generator can put many runs in
//! flight at once, measure them there, and then let them all finish.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::watch;

/// The faults a profile injects. Every field defaults to "no fault".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Execute never returns on its own: only the task's deadline (TIMED_OUT) or a
    /// Cancel ends it.
    pub hang: bool,
    /// Wait this long before starting (counts against the deadline), e.g. `"2s"`.
    #[serde(
        with = "convene_server::config::optional_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub delay: Option<Duration>,
    /// The first N attempts of every delegation return FAILED with `retryable = true`.
    pub fail_attempts: u32,
    /// The first N attempts of every delegation make their first round of tool calls
    /// (evidence stored, children delegated), then return FAILED with `retryable =
    /// true`: a retry repeats calls whose effects already happened.
    pub fail_attempts_after_tools: u32,
    /// Report this delegation id in the result instead of the task's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_delegation_id: Option<String>,
    /// Report claims without their evidence references.
    pub drop_evidence_refs: bool,
    /// Record evidence under this scheme (e.g. `other://`) instead of the tool's, so the
    /// ids fall outside the profile's evidence prefixes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence_scheme: Option<String>,
    /// Report evidence with a content hash that differs from the stored artifact's.
    pub corrupt_evidence_hash: bool,
    /// Exit the process once the first round of tool calls is done, before any result
    /// is returned (a worker killed mid-task). Only the standalone binary exits; a
    /// worker hosted in another process abandons the task instead, as if it had died.
    pub exit_process_after_tools: bool,
    /// Hold every delegation before it starts until a release file exists (counts
    /// against the deadline; Cancel ends it too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
}

/// The `hold` fault: delegations wait at their start until `release` exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hold {
    /// The file whose existence releases every held delegation (and lets later ones
    /// through at once). Checked by one poll per path and process, however many
    /// delegations wait on it.
    pub release: PathBuf,
    /// A file to which each delegation appends one line, its delegation id, as it
    /// begins to wait, so whoever holds the release can count the delegations held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
}

/// How often a release file is looked for.
const RELEASE_POLL: Duration = Duration::from_millis(20);

/// One open/closed flag per release file, fed by one poll task while anyone waits on it.
static GATES: LazyLock<Mutex<HashMap<PathBuf, watch::Sender<bool>>>> =
    LazyLock::new(Mutex::default);

impl Hold {
    /// Appends `delegation_id` to the log, then waits until the release file exists.
    pub async fn wait(&self, delegation_id: &str) {
        if let Some(log) = &self.log
            && let Err(e) = append_line(log, delegation_id).await
        {
            tracing::warn!(log = %log.display(), error = %e, "cannot record a held delegation");
        }
        let mut open = gate(&self.release);
        // The sender lives as long as a receiver does, so this only ends when released.
        let _ = open.wait_for(|open| *open).await;
    }
}

async fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await?;
    // One write of one short line: appends from many tasks and processes never mix.
    file.write_all(format!("{line}\n").as_bytes()).await?;
    file.flush().await
}

fn gates() -> std::sync::MutexGuard<'static, HashMap<PathBuf, watch::Sender<bool>>> {
    GATES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A receiver of the flag of `release`, starting its poll task when nobody waits on it
/// yet.
fn gate(release: &Path) -> watch::Receiver<bool> {
    let mut all = gates();
    if let Some(open) = all.get(release) {
        return open.subscribe();
    }
    let (open, receiver) = watch::channel(release.exists());
    all.insert(release.to_owned(), open.clone());
    tokio::spawn(poll_release(release.to_owned(), open));
    receiver
}

/// Follows the existence of `release` until nobody waits on it any more.
async fn poll_release(release: PathBuf, open: watch::Sender<bool>) {
    loop {
        tokio::time::sleep(RELEASE_POLL).await;
        let exists = tokio::fs::try_exists(&release).await.unwrap_or(false);
        open.send_if_modified(|was| std::mem::replace(was, exists) != exists);
        let mut all = gates();
        // Receivers subscribe under this lock, so none can appear between the check
        // and the removal.
        if open.receiver_count() == 0 {
            all.remove(&release);
            return;
        }
    }
}

impl Faults {
    /// Whether any fault is set.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }

    /// The evidence scheme to use instead of `tool_scheme` (without `://`).
    pub fn scheme<'a>(&'a self, tool_scheme: &'a str) -> &'a str {
        self.evidence_scheme
            .as_deref()
            .map_or(tool_scheme, |s| s.trim_end_matches("://"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_from_yaml_and_default_to_none() {
        let f: Faults = serde_yaml::from_str("{}").unwrap();
        assert!(!f.any());
        assert_eq!(f.scheme("logs"), "logs");
        let f: Faults =
            serde_yaml::from_str("{ delay: 2s, fail_attempts: 1, evidence_scheme: 'other://' }")
                .unwrap();
        assert!(f.any());
        assert_eq!(f.fail_attempts_after_tools, 0);
        assert_eq!(f.delay, Some(Duration::from_secs(2)));
        assert_eq!(f.scheme("logs"), "other");
        let err = serde_yaml::from_str::<Faults>("{ hang: true, crash: true }").unwrap_err();
        assert!(err.to_string().contains("crash"), "{err}");
        let f: Faults = serde_yaml::from_str("{ hold: { release: /tmp/go } }").unwrap();
        assert!(f.any());
        assert_eq!(f.hold.unwrap().release, PathBuf::from("/tmp/go"));
    }

    #[tokio::test]
    async fn held_delegations_are_logged_and_wait_for_the_release_file() {
        let dir = tempfile::tempdir().unwrap();
        let hold = Hold {
            release: dir.path().join("release"),
            log: Some(dir.path().join("held")),
        };
        let waiting: Vec<_> = (0..20)
            .map(|i| {
                let hold = hold.clone();
                tokio::spawn(async move { hold.wait(&format!("del-{i}")).await })
            })
            .collect();
        let held = || {
            std::fs::read_to_string(dir.path().join("held"))
                .unwrap_or_default()
                .lines()
                .count()
        };
        while held() < 20 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut lines: Vec<String> = std::fs::read_to_string(dir.path().join("held"))
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        lines.sort();
        assert_eq!(lines.len(), 20);
        assert!(lines.contains(&"del-7".to_owned()), "{lines:?}");
        // Nobody has been let through while the release file is missing.
        tokio::time::sleep(RELEASE_POLL * 5).await;
        assert!(waiting.iter().all(|w| !w.is_finished()));
        std::fs::write(&hold.release, b"").unwrap();
        for w in waiting {
            tokio::time::timeout(Duration::from_secs(30), w)
                .await
                .expect("released")
                .unwrap();
        }
        // Once released, later delegations pass at once.
        tokio::time::timeout(Duration::from_secs(30), hold.wait("del-late"))
            .await
            .expect("passes");
        assert_eq!(held(), 21);
    }
}
