//! The append-only decision log: one record per authorization decision (allow or deny)
//! and per revocation.
//!
//! [`DecisionLog`] is the seam for durable storage. [`JsonlDecisionLog`] appends JSON
//! lines to a file through one writer thread that commits in groups: every record
//! waiting when a write starts goes into the same `write` + `fsync`, so under load many
//! decisions share one disk flush, and [`DecisionLog::append`] returns only once its
//! record is on disk — a decision is never answered before it is logged.
//! [`MemoryDecisionLog`] keeps records in memory for tests and throwaway setups.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, mpsc};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// Most records committed by one write.
const MAX_BATCH: usize = 1024;

/// The decision log cannot be opened, written or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// An I/O error on the log file.
    #[error("decision log {path}: cannot {action}: {detail}")]
    Io {
        /// The log file.
        path: String,
        /// What was being done.
        action: &'static str,
        /// The I/O error.
        detail: String,
    },
    /// The writer thread is gone (the service is shutting down).
    #[error("decision log {path} is closed")]
    Closed {
        /// The log file.
        path: String,
    },
    /// A line of the log file does not parse.
    #[error("decision log {path}, line {line}: {detail}")]
    Corrupt {
        /// The log file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What the parser said.
        detail: String,
    },
}

/// One authorization decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthorizeRecord {
    /// Id of the decision (UUIDv7), returned to the caller as `decision_id`.
    pub decision_id: String,
    /// When it was made, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The token's `jti` (empty when the token did not verify).
    pub token_id: String,
    /// The token's run.
    pub run_id: String,
    /// The token's delegation.
    pub delegation_id: String,
    /// The token's tenant.
    pub tenant: String,
    /// The principal the token acts for.
    pub principal: String,
    /// The profile holding the token.
    pub profile_id: String,
    /// Who presented the token.
    pub audience: String,
    /// The tool asked for.
    pub tool: String,
    /// The action asked for.
    pub action: String,
    /// The resource asked for.
    pub resource: String,
    /// The tool call, as the caller named it.
    pub tool_call_id: String,
    /// Whether the call was allowed.
    pub allowed: bool,
    /// The wire reason, e.g. `AUTHORIZE_REASON_ALLOWED`.
    pub reason: String,
    /// What would have to change, in words.
    pub detail: String,
    /// Calls counted against the token after this decision.
    pub calls_used: u32,
    /// The token's lease epoch (see `Claims::lease_epoch`); 0 and left out when the
    /// supervisor leases no runs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease_epoch: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One revocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeRecord {
    /// Id of the decision (UUIDv7).
    pub decision_id: String,
    /// When it was made, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The principal that revoked.
    pub principal: String,
    /// `token` or `run`.
    pub target: String,
    /// The revoked token id or run id.
    pub id: String,
    /// Why, as the principal said.
    pub reason: String,
}

/// A record of the decision log, tagged with its `kind` on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LogEntry {
    /// An authorization decision.
    Authorize(AuthorizeRecord),
    /// A revocation.
    Revoke(RevokeRecord),
}

/// An append-only store of decisions.
#[async_trait]
pub trait DecisionLog: Send + Sync + fmt::Debug {
    /// Appends `entry`; returns once it is durable (as durable as the store is).
    async fn append(&self, entry: LogEntry) -> Result<(), LogError>;

    /// The database the records are rows of, if they are: a policy state in the same
    /// database writes a decision in the transaction that counts its call.
    fn database(&self) -> Option<&convene_store::Database> {
        None
    }
}

/// Decisions kept in memory, in append order.
#[derive(Debug, Default)]
pub struct MemoryDecisionLog {
    entries: Mutex<Vec<LogEntry>>,
}

impl MemoryDecisionLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of every entry so far.
    pub fn entries(&self) -> Vec<LogEntry> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[async_trait]
impl DecisionLog for MemoryDecisionLog {
    async fn append(&self, entry: LogEntry) -> Result<(), LogError> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(entry);
        Ok(())
    }
}

/// A record waiting for the writer, with the channel its appender waits on.
struct Pending {
    line: Vec<u8>,
    done: oneshot::Sender<Result<(), String>>,
}

/// Decisions as JSON lines in a file, group-committed by a writer thread.
pub struct JsonlDecisionLog {
    path: PathBuf,
    queue: mpsc::Sender<Pending>,
}

impl fmt::Debug for JsonlDecisionLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonlDecisionLog")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl JsonlDecisionLog {
    /// Opens (creating it and its directory when missing) the log at `path` for
    /// appending, and starts its writer thread. The thread ends once the log is dropped
    /// and every queued record is written.
    ///
    /// # Errors
    ///
    /// [`LogError::Io`] when the directory or file cannot be created or opened.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, LogError> {
        let path = path.into();
        let io = |action, e: std::io::Error| LogError::Io {
            path: path.display().to_string(),
            action,
            detail: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io("create its directory", e))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io("open", e))?;
        let len = file.metadata().map_err(|e| io("stat", e))?.len();
        let (queue, receiver) = mpsc::channel();
        let shown = path.display().to_string();
        std::thread::Builder::new()
            .name("decision-log".into())
            .spawn(move || write_batches(file, len, &receiver, &shown))
            .map_err(|e| io("start its writer thread", e))?;
        Ok(Self { path, queue })
    }

    /// The log file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads every entry of the log file at `path`, in order.
    ///
    /// # Errors
    ///
    /// [`LogError::Io`] when the file cannot be read, [`LogError::Corrupt`] naming the
    /// first line that does not parse.
    pub fn read(path: impl AsRef<Path>) -> Result<Vec<LogEntry>, LogError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|e| LogError::Io {
            path: shown.clone(),
            action: "open",
            detail: e.to_string(),
        })?;
        let mut entries = Vec::new();
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| LogError::Io {
                path: shown.clone(),
                action: "read",
                detail: e.to_string(),
            })?;
            let entry = serde_json::from_str(&line).map_err(|e| LogError::Corrupt {
                path: shown.clone(),
                line: i + 1,
                detail: e.to_string(),
            })?;
            entries.push(entry);
        }
        Ok(entries)
    }
}

#[async_trait]
impl DecisionLog for JsonlDecisionLog {
    async fn append(&self, entry: LogEntry) -> Result<(), LogError> {
        // Serialized here, on the caller's task, so the writer thread only copies bytes.
        let mut line = serde_json::to_vec(&entry).map_err(|e| LogError::Io {
            path: self.path.display().to_string(),
            action: "encode a record",
            detail: e.to_string(),
        })?;
        line.push(b'\n');
        let (done, committed) = oneshot::channel();
        let closed = || LogError::Closed {
            path: self.path.display().to_string(),
        };
        self.queue
            .send(Pending { line, done })
            .map_err(|_| closed())?;
        committed
            .await
            .map_err(|_| closed())?
            .map_err(|detail| LogError::Io {
                path: self.path.display().to_string(),
                action: "append",
                detail,
            })
    }
}

/// The writer thread: takes the first waiting record, then every other one already
/// queued (up to [`MAX_BATCH`]), writes them with one `write` and one `fsync`, and tells
/// each appender the outcome.
fn write_batches(mut file: File, mut len: u64, queue: &mpsc::Receiver<Pending>, shown: &str) {
    let mut buffer = Vec::new();
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        buffer.clear();
        for pending in &batch {
            buffer.extend_from_slice(&pending.line);
        }
        let outcome = file
            .write_all(&buffer)
            .and_then(|()| file.sync_data())
            .map_err(|e| e.to_string());
        match &outcome {
            Ok(()) => len += buffer.len() as u64,
            Err(error) => {
                tracing::error!(path = shown, %error, records = batch.len(), "decision log write failed");
                // Cut a partial write off, so the file stays whole lines.
                if let Err(error) = file.set_len(len) {
                    tracing::error!(path = shown, %error, "cannot truncate a partial decision log write");
                }
            }
        }
        for pending in batch {
            // An appender that gave up waiting no longer cares about the outcome.
            let _ = pending.done.send(outcome.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn record(i: u32) -> LogEntry {
        LogEntry::Authorize(AuthorizeRecord {
            decision_id: format!("d{i}"),
            time: "2026-01-01T00:00:00.000Z".into(),
            token_id: "t".into(),
            run_id: "r".into(),
            delegation_id: "del".into(),
            tenant: "acme".into(),
            principal: "p".into(),
            profile_id: "prof".into(),
            audience: "worker:prof".into(),
            tool: "search_logs@1".into(),
            action: "logs:read".into(),
            resource: "service/a".into(),
            tool_call_id: String::new(),
            allowed: i.is_multiple_of(2),
            reason: "AUTHORIZE_REASON_ALLOWED".into(),
            detail: "ok".into(),
            calls_used: i,
            lease_epoch: 0,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_appends_all_land_as_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/decisions.jsonl");
        let log = Arc::new(JsonlDecisionLog::open(&path).unwrap());
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let log = log.clone();
                tokio::spawn(async move { log.append(record(i)).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let mut entries = JsonlDecisionLog::read(&path).unwrap();
        assert_eq!(entries.len(), 200);
        entries.sort_by_key(|e| match e {
            LogEntry::Authorize(r) => r.calls_used,
            LogEntry::Revoke(_) => u32::MAX,
        });
        assert_eq!(entries[7], record(7));
    }

    #[tokio::test]
    async fn reopening_appends_after_existing_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        JsonlDecisionLog::open(&path)
            .unwrap()
            .append(record(1))
            .await
            .unwrap();
        let log = JsonlDecisionLog::open(&path).unwrap();
        log.append(LogEntry::Revoke(RevokeRecord {
            decision_id: "d2".into(),
            time: "2026-01-01T00:00:00.000Z".into(),
            principal: "supervisor".into(),
            target: "run".into(),
            id: "run-1".into(),
            reason: "done".into(),
        }))
        .await
        .unwrap();
        let entries = JsonlDecisionLog::read(&path).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0], record(1));
        assert!(matches!(&entries[1], LogEntry::Revoke(r) if r.id == "run-1"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.lines()
                .nth(1)
                .unwrap()
                .starts_with(r#"{"kind":"revoke""#)
        );
    }

    #[test]
    fn a_corrupt_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::fs::write(&path, "{\"kind\":\"revoke\"}\n").unwrap();
        let err = JsonlDecisionLog::read(&path).unwrap_err();
        assert!(matches!(err, LogError::Corrupt { line: 1, .. }), "{err}");
    }
}
