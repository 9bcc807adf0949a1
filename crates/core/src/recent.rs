//! A bounded map of recent entries that a process shares between threads: the one
//! piece here that is not a pure function, used where a service remembers what it
//! checked or wrote lately (verified task tokens, evidence records it stored).
//!
//! Entries live in two generations. Inserts go to the current one; a lookup that finds
//! an entry in the previous one moves it to the current one, so what is still in use
//! stays. When the current generation is full it becomes the previous one, and the old
//! previous generation — the entries nobody asked for during a whole generation — is
//! retired: dropped on a thread of its own, outside the lock.
//!
//! A map that is simply cleared when full does that work under its lock, on whichever
//! thread inserts next: dropping thousands of entries (a verified token's claims hold
//! dozens of strings) takes milliseconds while every other lookup waits, and afterwards
//! everything in use misses at once. Under load that was a stall of the whole process
//! every few seconds.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock, PoisonError};

/// A map holding at most `capacity` entries, the most recently inserted or read.
#[derive(Debug)]
pub struct RecentMap<K, V> {
    generations: Mutex<Generations<K, V>>,
    /// Entries a generation holds before it is retired.
    per_generation: usize,
}

#[derive(Debug)]
struct Generations<K, V> {
    current: HashMap<K, V>,
    previous: HashMap<K, V>,
}

impl<K, V> RecentMap<K, V>
where
    K: Eq + Hash + Send + 'static,
    V: Send + 'static,
{
    /// A map that holds at most `capacity` entries (at least two).
    pub fn new(capacity: usize) -> Self {
        Self {
            generations: Mutex::new(Generations {
                current: HashMap::new(),
                previous: HashMap::new(),
            }),
            per_generation: (capacity / 2).max(1),
        }
    }

    /// What `read` makes of the entry for `key`, if there is one; an entry found among
    /// the older ones is kept as a recent one.
    pub fn get_with<Q, R>(&self, key: &Q, read: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (found, retired) = {
            let mut generations = self.lock();
            if let Some(value) = generations.current.get(key) {
                return Some(read(value));
            }
            let (key, value) = generations.previous.remove_entry(key)?;
            let found = read(&value);
            generations.current.insert(key, value);
            (found, self.turn_over(&mut generations))
        };
        retire(retired);
        Some(found)
    }

    /// Remembers `value` for `key`, in place of any entry it had.
    pub fn insert(&self, key: K, value: V) {
        let (replaced, retired) = {
            let mut generations = self.lock();
            let replaced = generations.previous.remove(&key);
            generations.current.insert(key, value);
            (replaced, self.turn_over(&mut generations))
        };
        drop(replaced);
        retire(retired);
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        let generations = self.lock();
        generations.current.len() + generations.previous.len()
    }

    /// Whether the map holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// When the current generation is full, makes it the previous one and returns the
    /// generation it replaces.
    fn turn_over(&self, generations: &mut Generations<K, V>) -> Option<HashMap<K, V>> {
        if generations.current.len() < self.per_generation {
            return None;
        }
        let full = std::mem::take(&mut generations.current);
        Some(std::mem::replace(&mut generations.previous, full))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<K, V>> {
        // Entries are plain data: a panic elsewhere leaves them usable.
        self.generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Something retired, to be dropped later.
type Retired = Box<dyn Send>;

/// Drops a retired generation on the process's retiring thread, or here when it holds
/// nothing or that thread cannot be had.
fn retire<K: Send + 'static, V: Send + 'static>(generation: Option<HashMap<K, V>>) {
    let Some(generation) = generation.filter(|g| !g.is_empty()) else {
        return;
    };
    let boxed: Retired = Box::new(generation);
    if let Some(Err(mpsc::SendError(boxed))) = retirer().map(|tx| tx.send(boxed)) {
        drop(boxed);
    }
}

/// The sender to the thread that drops retired generations, started on first use;
/// None when no thread could be started.
fn retirer() -> Option<&'static mpsc::Sender<Retired>> {
    static RETIRER: OnceLock<Option<mpsc::Sender<Retired>>> = OnceLock::new();
    RETIRER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Retired>();
            std::thread::Builder::new()
                .name("convene-retire".to_owned())
                .spawn(move || rx.into_iter().for_each(drop))
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn an_entry_is_found_until_two_generations_passed_it_by() {
        let map = RecentMap::new(8);
        map.insert("a".to_owned(), 1);
        assert_eq!(map.get_with("a", |v| *v), Some(1));
        assert_eq!(map.get_with("b", |v| *v), None);
        // Four entries fill a generation, which becomes the previous one.
        for i in 0..3 {
            map.insert(format!("x{i}"), i);
        }
        assert_eq!(map.len(), 4);
        // Four more fill the next: "a" and its generation, not read meanwhile, go.
        for i in 3..7 {
            map.insert(format!("x{i}"), i);
        }
        assert_eq!(map.len(), 4);
        for i in 3..7 {
            assert_eq!(map.get_with(format!("x{i}").as_str(), |v| *v), Some(i));
        }
        assert_eq!(map.get_with("a", |v| *v), None);
        assert_eq!(map.get_with("x0", |v| *v), None);
    }

    #[test]
    fn it_never_holds_more_than_its_capacity() {
        let map = RecentMap::new(100);
        for i in 0..10_000 {
            map.insert(i, i);
            assert!(map.len() <= 100, "{} entries after {i}", map.len());
        }
        // The most recent ones are all there.
        for i in 9_950..10_000 {
            assert_eq!(map.get_with(&i, |v| *v), Some(i));
        }
    }

    #[test]
    fn an_entry_in_use_outlives_its_generation() {
        let map = RecentMap::new(8);
        map.insert(0, "kept");
        map.insert(1, "dropped");
        for i in 2..30 {
            // 0 is read as often as new entries come; 1 never.
            assert_eq!(map.get_with(&0, |v| *v), Some("kept"));
            map.insert(i, "filler");
        }
        assert_eq!(map.get_with(&0, |v| *v), Some("kept"));
        assert_eq!(map.get_with(&1, |v| *v), None);
    }

    #[test]
    fn inserting_again_replaces_the_entry() {
        let map = RecentMap::new(4);
        map.insert("k", 1);
        map.insert("x", 0);
        map.insert("y", 0);
        // "k" is in the previous generation now; the new value wins there too.
        map.insert("k", 2);
        assert_eq!(map.get_with("k", |v| *v), Some(2));
        assert!(map.len() <= 4);
    }

    /// Records the thread that drops it.
    struct Witness(Arc<Mutex<Vec<std::thread::ThreadId>>>);

    impl Drop for Witness {
        fn drop(&mut self) {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(std::thread::current().id());
        }
    }

    #[test]
    fn a_retired_generation_is_dropped_on_another_thread() {
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let map = RecentMap::new(4);
        for i in 0..2 {
            map.insert(i, Witness(dropped.clone()));
        }
        // Two more fill the next generation and retire the first two entries.
        for i in 2..4 {
            map.insert(i, Witness(dropped.clone()));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while dropped.lock().expect("lock").len() < 2 {
            assert!(
                Instant::now() < deadline,
                "the retired entries were not dropped"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let here = std::thread::current().id();
        let threads = dropped.lock().expect("lock").clone();
        assert_eq!(threads.len(), 2, "only the retired entries are dropped");
        assert!(threads.iter().all(|t| *t != here), "{threads:?}");
        assert_eq!(map.get_with(&3, |_| ()), Some(()));
    }
}
