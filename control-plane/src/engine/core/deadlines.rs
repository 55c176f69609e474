//! Deadlines keyed by an id, earliest first. Setting a key again moves its
//! deadline and removing it forgets it, so deadlines that stop mattering
//! (a run dispatched before its start deadline, an attempt that ended
//! before its timeout) leave nothing behind — unlike entries in a timer
//! heap, which would pile up at a high run rate.

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use crate::clock::Mono;

/// See the module docs.
#[derive(Debug)]
pub(super) struct Deadlines<K: Ord + Hash + Clone> {
    order: BTreeSet<(Mono, K)>,
    at: HashMap<K, Mono>,
}

impl<K: Ord + Hash + Clone> Default for Deadlines<K> {
    fn default() -> Self {
        Deadlines { order: BTreeSet::new(), at: HashMap::new() }
    }
}

impl<K: Ord + Hash + Clone> Deadlines<K> {
    /// Sets (or moves) `key`'s deadline.
    pub(super) fn set(&mut self, key: K, at: Mono) {
        self.remove(&key);
        self.order.insert((at, key.clone()));
        self.at.insert(key, at);
    }

    /// Forgets `key` (no-op if absent).
    pub(super) fn remove(&mut self, key: &K) {
        if let Some(at) = self.at.remove(key) {
            self.order.remove(&(at, key.clone()));
        }
    }

    /// The earliest deadline.
    pub(super) fn next(&self) -> Option<Mono> {
        self.order.first().map(|(at, _)| *at)
    }

    /// Takes the earliest key whose deadline is at or before `now`.
    pub(super) fn pop_due(&mut self, now: Mono) -> Option<K> {
        let (at, _) = self.order.first()?;
        if *at > now {
            return None;
        }
        let (_, key) = self.order.pop_first()?;
        self.at.remove(&key);
        Some(key)
    }

    /// How many keys have a deadline.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }
}
