//! The bench's `hold`: a profile's delegations wait at their start until a release file
//! appears, so a load generator (`convene bench --scale`) can put many runs in flight at
//! once, measure them there, and then let them all finish.
//!
//! A profile asks for it with a `hold` section next to its other settings:
//! `hold: { release: <file>, log: <file> }`. A held delegation's wait counts against its
//! deadline, and Cancel ends it too. Unlike fault injection ([`crate::faults`]), `hold`
//! is part of every build: the benchmark runs the shipped binaries.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::watch;

/// A profile's `hold` section: its delegations wait at their start until `release`
/// exists.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_parses_from_yaml() {
        let hold: Hold = serde_yaml::from_str("{ release: /tmp/go }").unwrap();
        assert_eq!(hold.release, PathBuf::from("/tmp/go"));
        assert_eq!(hold.log, None);
        let err = serde_yaml::from_str::<Hold>("{ release: /tmp/go, wait: 1s }").unwrap_err();
        assert!(err.to_string().contains("wait"), "{err}");
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
