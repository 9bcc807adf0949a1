//! How many `WatchRun` and `WatchEvents` streams each principal holds open on this
//! replica, against `max_watch_streams`.
//!
//! A stream takes a place before it starts and holds it in its task; the place is given
//! back when the task ends, which it does when the stream ends, its client goes away or
//! the supervisor shuts down. One stream past the limit is refused at once with
//! `RESOURCE_EXHAUSTED` and the retry hint StartRun's refusal carries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::admission::RETRY_AFTER;
use crate::error::Error;

/// Open streams by principal id.
#[derive(Debug)]
pub(crate) struct Streams {
    open: Mutex<HashMap<String, usize>>,
    max: usize,
}

/// One open stream's place; dropping it gives the place back.
#[derive(Debug)]
pub(crate) struct StreamPlace {
    streams: Arc<Streams>,
    principal: String,
}

impl Drop for StreamPlace {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().expect("streams lock poisoned");
        if let Some(n) = open.get_mut(&self.principal) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.principal);
            }
        }
    }
}

impl Streams {
    /// At most `max` streams per principal.
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::new(HashMap::new()),
            max,
        })
    }

    /// A place for one more stream of `principal`, or the refusal to answer the call
    /// with.
    pub(crate) fn open(self: &Arc<Self>, principal: &str) -> Result<StreamPlace, Error> {
        let mut open = self.open.lock().expect("streams lock poisoned");
        let n = open.entry(principal.to_owned()).or_insert(0);
        if *n >= self.max {
            return Err(Error::Overloaded {
                message: format!(
                    "principal {principal} holds {} WatchRun and WatchEvents streams open on \
                     this supervisor, its limit (max_watch_streams); close one, or retry in \
                     {}s",
                    self.max,
                    RETRY_AFTER.as_secs()
                ),
                retry_after: RETRY_AFTER,
            });
        }
        *n += 1;
        Ok(StreamPlace {
            streams: self.clone(),
            principal: principal.to_owned(),
        })
    }

    /// Streams `principal` holds open now.
    #[cfg(test)]
    pub(crate) fn held(&self, principal: &str) -> usize {
        self.open
            .lock()
            .expect("streams lock poisoned")
            .get(principal)
            .copied()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_principal_has_its_own_places_and_gets_them_back() {
        let streams = Streams::new(2);
        let a = streams.open("alice").expect("first");
        let b = streams.open("alice").expect("second");
        let refused = streams.open("alice").expect_err("third");
        assert!(
            matches!(&refused, Error::Overloaded { retry_after, .. } if *retry_after == RETRY_AFTER)
        );
        assert!(
            refused.to_string().contains("max_watch_streams")
                && refused.to_string().contains("alice"),
            "{refused}"
        );
        // Another principal is not held back by alice's streams.
        let c = streams.open("bob").expect("bob's first");
        drop(a);
        assert_eq!(streams.held("alice"), 1);
        let d = streams.open("alice").expect("a place was given back");
        drop((b, c, d));
        assert_eq!(streams.held("alice"), 0);
        assert!(
            streams.open.lock().unwrap().is_empty(),
            "no entry is left behind"
        );
    }
}
