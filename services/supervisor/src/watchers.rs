//! [`RunWatchers`]: the store's commit notes, routed to the `WatchRun` streams of the
//! run they are about.
//!
//! The store announces every commit of every run on one broadcast channel. A stream
//! that listened there itself would wake for each of them, so a thousand watched runs
//! would mean a thousand wake-ups per commit. Instead one task listens and wakes only
//! the watchers of the committed run.
//!
//! A note carries the events of the commit it announces when this process made it, so
//! a watcher that has seen everything before them sends them on without reading the
//! store; after a gap (commits it slept through, lost notes, another replica's commit)
//! it reads the store from where it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use convene_proto::v1;
use tokio::sync::{broadcast, watch};

use crate::store::RunStore;

/// What a run's watchers are told: the highest event sequence committed so far, the
/// events of the latest commit when known, and how often notes were lost (a watcher
/// re-reads the store after a loss whatever the sequence says).
#[derive(Debug, Clone, Default)]
pub(crate) struct Note {
    /// The highest run-event sequence a commit reported.
    pub(crate) sequence: u64,
    /// Counts the times the router fell behind the store's broadcast.
    pub(crate) lost: u64,
    /// The run events of the commit that reported `sequence`, ending with it, when this
    /// process made that commit.
    pub(crate) events: Option<Arc<[v1::RunEvent]>>,
    /// The run as the commit that reported `sequence` stored it, when that commit ended
    /// the run and this process made it.
    pub(crate) ended: Option<Arc<v1::Run>>,
}

impl Note {
    /// The events after `last` when this note alone holds all of them: its events
    /// follow on from `last` with no gap. `None` means: read the store.
    pub(crate) fn events_after(&self, last: u64) -> Option<Vec<v1::RunEvent>> {
        let events = self.events.as_deref()?;
        let first = events.first()?.sequence;
        let contiguous = events
            .windows(2)
            .all(|w| w[1].sequence == w[0].sequence + 1);
        (contiguous && first <= last + 1 && events.last()?.sequence == self.sequence).then(|| {
            events
                .iter()
                .filter(|e| e.sequence > last)
                .cloned()
                .collect()
        })
    }
}

type Routes = Mutex<HashMap<String, watch::Sender<Note>>>;

/// Routes commit notes to each run's watchers. See the [module docs](self).
pub(crate) struct RunWatchers {
    store: Arc<dyn RunStore>,
    routes: Arc<Routes>,
    started: OnceLock<()>,
}

fn lock(routes: &Routes) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Note>>> {
    routes.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RunWatchers {
    pub(crate) fn new(store: Arc<dyn RunStore>) -> Self {
        Self {
            store,
            routes: Arc::new(Mutex::new(HashMap::new())),
            started: OnceLock::new(),
        }
    }

    /// Watches `run_id`: the receiver changes on every later commit of the run that
    /// reports new events (and when notes were lost). Must be called inside a Tokio
    /// runtime; the first call starts the routing task.
    pub(crate) fn watch(&self, run_id: &str) -> Watch {
        self.started.get_or_init(|| {
            tokio::spawn(route(self.store.subscribe(), Arc::downgrade(&self.routes)));
        });
        let receiver = lock(&self.routes)
            .entry(run_id.to_owned())
            .or_insert_with(|| watch::channel(Note::default()).0)
            .subscribe();
        Watch {
            receiver: Some(receiver),
            run_id: run_id.to_owned(),
            routes: self.routes.clone(),
        }
    }

    /// How many runs have watchers (for tests).
    #[cfg(test)]
    fn watched(&self) -> usize {
        lock(&self.routes).len()
    }
}

/// One watcher's receiver; dropping it forgets the run once nobody else watches it.
pub(crate) struct Watch {
    receiver: Option<watch::Receiver<Note>>,
    run_id: String,
    routes: Arc<Routes>,
}

impl Watch {
    /// The receiver.
    pub(crate) fn receiver(&mut self) -> &mut watch::Receiver<Note> {
        self.receiver.as_mut().expect("present until dropped")
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        drop(self.receiver.take());
        let mut routes = lock(&self.routes);
        if routes
            .get(&self.run_id)
            .is_some_and(|s| s.receiver_count() == 0)
        {
            routes.remove(&self.run_id);
        }
    }
}

async fn route(
    mut notes: broadcast::Receiver<crate::store::Committed>,
    routes: std::sync::Weak<Routes>,
) {
    loop {
        let note = notes.recv().await;
        let Some(routes) = routes.upgrade() else {
            return;
        };
        let routes = lock(&routes);
        match note {
            Ok(c) => {
                if let Some(sender) = routes.get(&c.run_id) {
                    sender.send_if_modified(|n| {
                        if c.last_sequence <= n.sequence {
                            return false;
                        }
                        n.sequence = c.last_sequence;
                        n.events = c.events.clone();
                        n.ended = c.ended.clone();
                        true
                    });
                }
            }
            Err(broadcast::error::RecvError::Lagged(_)) => {
                for sender in routes.values() {
                    sender.send_modify(|n| {
                        n.lost += 1;
                        n.events = None;
                        n.ended = None;
                    });
                }
            }
            // The store is gone: dropping the senders ends every watcher.
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use crate::store::Committed;

    fn note(run_id: &str, last_sequence: u64) -> Committed {
        Committed {
            run_id: run_id.to_owned(),
            last_sequence,
            cloud: false,
            events: None,
            ended: None,
        }
    }

    #[tokio::test]
    async fn only_the_committed_runs_watchers_wake_and_forgotten_runs_go() {
        let store = Arc::new(MemoryStore::default());
        let watchers = RunWatchers::new(store.clone());
        let mut a = watchers.watch("a");
        let mut b = watchers.watch("b");
        let mut a2 = watchers.watch("a");
        assert_eq!(watchers.watched(), 2);

        store.announce_for_test(note("a", 3));
        tokio::time::timeout(std::time::Duration::from_secs(5), a.receiver().changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.receiver().borrow_and_update().sequence, 3);
        assert_eq!(a2.receiver().borrow_and_update().sequence, 3);
        assert!(
            !b.receiver().has_changed().unwrap(),
            "b's run did not change"
        );

        // No new events: nobody wakes.
        store.announce_for_test(note("a", 2));
        store.announce_for_test(note("b", 1));
        tokio::time::timeout(std::time::Duration::from_secs(5), b.receiver().changed())
            .await
            .unwrap()
            .unwrap();
        assert!(!a.receiver().has_changed().unwrap());

        drop(a);
        assert_eq!(watchers.watched(), 2, "a2 still watches a");
        drop(a2);
        drop(b);
        assert_eq!(watchers.watched(), 0);
    }

    fn events(sequences: &[u64]) -> Option<Arc<[v1::RunEvent]>> {
        Some(
            sequences
                .iter()
                .map(|&sequence| v1::RunEvent {
                    sequence,
                    ..Default::default()
                })
                .collect(),
        )
    }

    fn sequences(events: Option<Vec<v1::RunEvent>>) -> Option<Vec<u64>> {
        events.map(|e| e.iter().map(|e| e.sequence).collect())
    }

    #[test]
    fn a_note_stands_in_for_a_read_only_when_it_follows_on_without_a_gap() {
        let note = |seqs: &[u64], sequence| Note {
            sequence,
            lost: 0,
            events: events(seqs),
            ended: None,
        };
        // Right after what the watcher has: all of them.
        assert_eq!(
            sequences(note(&[4, 5, 6], 6).events_after(3)),
            Some(vec![4, 5, 6])
        );
        // Overlapping what it has: only the new ones.
        assert_eq!(
            sequences(note(&[4, 5, 6], 6).events_after(4)),
            Some(vec![5, 6])
        );
        // A commit it slept through lies between: read the store.
        assert_eq!(sequences(note(&[6, 7], 7).events_after(3)), None);
        // Events of an older commit than the note's sequence: read the store.
        assert_eq!(sequences(note(&[4, 5], 7).events_after(3)), None);
        // Not contiguous, or none carried (another replica's commit): read the store.
        assert_eq!(sequences(note(&[4, 6], 6).events_after(3)), None);
        assert_eq!(
            sequences(
                Note {
                    sequence: 4,
                    lost: 0,
                    events: None,
                    ended: None,
                }
                .events_after(3)
            ),
            None
        );
    }

    #[tokio::test]
    async fn a_note_carries_the_commits_events_and_a_loss_drops_them() {
        let store = Arc::new(MemoryStore::default());
        let watchers = RunWatchers::new(store.clone());
        let mut a = watchers.watch("a");
        store.announce_for_test(Committed {
            events: events(&[1, 2]),
            ..note("a", 2)
        });
        tokio::time::timeout(std::time::Duration::from_secs(5), a.receiver().changed())
            .await
            .unwrap()
            .unwrap();
        let seen = a.receiver().borrow_and_update().clone();
        assert_eq!(sequences(seen.events_after(0)), Some(vec![1, 2]));

        // A later commit without events (found by polling) clears them.
        store.announce_for_test(note("a", 3));
        tokio::time::timeout(std::time::Duration::from_secs(5), a.receiver().changed())
            .await
            .unwrap()
            .unwrap();
        let seen = a.receiver().borrow_and_update().clone();
        assert_eq!(seen.sequence, 3);
        assert!(seen.events.is_none());
    }
}
