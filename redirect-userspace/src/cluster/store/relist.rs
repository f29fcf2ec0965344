//! The rules every watched kind is held by, written once: each object at its last good version,
//! and a list that starts over gathered beside what is served and swapped in whole once complete.
use std::collections::BTreeMap;

use super::{Change, Key};
use crate::{
    cluster::kinds::{Converted, Kind, Object},
    config::ConfigError,
    live::WatchStatus,
};

/// What a watch holds of its kind, however it holds it.
pub(super) trait Held: Default + PartialEq {
    /// One object as held.
    type Good;

    /// The version in force at `key`, if it has one.
    fn good(&self, key: &Key) -> Option<Self::Good>;

    /// Holds `key` at `good` with no errors; with `errors`, its latest version was refused and
    /// `good` is its last good version (if it had one). Whether anything held changed.
    fn put(&mut self, key: Key, good: Option<Self::Good>, errors: Vec<ConfigError>) -> bool;

    /// Forgets `key`; whether it was held.
    fn remove(&mut self, key: &Key) -> bool;

    /// Objects held, those refused that never had a good version included.
    fn len(&self) -> usize;

    /// After a change to `key` in what is served.
    fn settle(&mut self, _key: &Key) {}

    /// After a complete list, before it is served.
    fn settle_all(&mut self) {}
}

/// A watched kind: what is served, the list being gathered, and the watch's status.
#[derive(Debug, Default)]
pub(super) struct Relisting<H> {
    pub(super) served: H,
    /// The list being gathered, between [`Change::Relist`] and [`Change::Listed`].
    gathering: Option<H>,
    pub(super) status: WatchStatus,
}

impl<H: Held> Relisting<H> {
    pub(super) fn new(kind: Kind) -> Self {
        Relisting {
            served: H::default(),
            gathering: None,
            status: WatchStatus {
                kind: kind.label(),
                installed: true,
                ..WatchStatus::default()
            },
        }
    }

    /// Takes in one change at time `now`; `held` says what of an accepted object is held
    /// (`None`: it is refused). Returns whether what is served changed.
    pub(super) fn take_in(
        &mut self,
        change: Change,
        now: &str,
        held: impl FnOnce(Object) -> Option<H::Good>,
    ) -> bool {
        match change {
            Change::Watching(_, api_version) => {
                self.status.api_version = Some(api_version);
                self.status.installed = true;
                false
            }
            Change::Relist(_) => {
                self.gathering = Some(H::default());
                false
            }
            Change::Upsert(_, key, converted) => {
                let Converted { object, errors, .. } = *converted;
                match object.and_then(held) {
                    Some(good) => self.upsert(key, Some(good), Vec::new(), now),
                    None => {
                        let last_good = self.last_good(&key);
                        self.upsert(key, last_good, errors, now)
                    }
                }
            }
            Change::Deleted(_, key) => {
                self.status.last_event_at = Some(now.to_string());
                match &mut self.gathering {
                    Some(gathering) => {
                        gathering.remove(&key);
                        false
                    }
                    None => self.served.remove(&key),
                }
            }
            Change::Listed(_) => {
                let mut listed = self.gathering.take().unwrap_or_default();
                listed.settle_all();
                let changed = listed != self.served || !self.status.synced;
                self.served = listed;
                self.status.listed();
                changed
            }
            Change::NotInstalled(_) => {
                let changed = self.served.len() > 0 || !self.status.synced;
                self.served = H::default();
                self.gathering = None;
                self.status.not_installed();
                changed
            }
            Change::Failed(_, message) => {
                self.status.errors += 1;
                self.status.last_error = Some(message);
                self.status.last_error_at = Some(now.to_string());
                false
            }
        }
    }

    /// The last good version of `key`: from the list being gathered, else from what is served.
    fn last_good(&self, key: &Key) -> Option<H::Good> {
        let gathered = self.gathering.as_ref().and_then(|g| g.good(key));
        gathered.or_else(|| self.served.good(key))
    }

    /// A change goes to the list being gathered (served once complete), else to what is served.
    fn upsert(
        &mut self,
        key: Key,
        good: Option<H::Good>,
        errors: Vec<ConfigError>,
        now: &str,
    ) -> bool {
        self.status.last_event_at = Some(now.to_string());
        match &mut self.gathering {
            Some(gathering) => {
                gathering.put(key, good, errors);
                false
            }
            None => {
                let changed = self.served.put(key.clone(), good, errors);
                self.served.settle(&key);
                changed
            }
        }
    }
}

/// One object as most kinds are held.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Slot {
    /// The version in force; `None` for an object never valid.
    pub(super) good: Option<Object>,
    /// Why the latest version was refused; empty when it is the one in force.
    pub(super) errors: Vec<ConfigError>,
}

/// Most kinds: each object in its [`Slot`], by key.
pub(super) type Slots = BTreeMap<Key, Slot>;

impl Held for Slots {
    type Good = Object;

    fn good(&self, key: &Key) -> Option<Object> {
        self.get(key)?.good.clone()
    }

    fn put(&mut self, key: Key, good: Option<Object>, errors: Vec<ConfigError>) -> bool {
        let slot = Slot { good, errors };
        self.insert(key, slot.clone()) != Some(slot)
    }

    fn remove(&mut self, key: &Key) -> bool {
        BTreeMap::remove(self, key).is_some()
    }

    fn len(&self) -> usize {
        BTreeMap::len(self)
    }
}
