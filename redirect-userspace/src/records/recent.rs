//! The recent records, a bounded ring (the oldest go first), and the filter `/connections` and
//! `redirect config connections` apply to them and to what they follow.
use std::{collections::VecDeque, sync::Arc, sync::Mutex};

use super::Record;
use crate::lock::Locked;

/// Which records to show: all by default, or those of a client namespace, of a service, or both.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Filter {
    /// The client's namespace.
    pub namespace: Option<String>,
    /// `namespace/name` of the service the connection was decided for.
    pub service: Option<String>,
}

impl Filter {
    pub(crate) fn matches(&self, record: &Record) -> bool {
        let same = |want: &Option<String>, have: &Option<super::Name>| match want {
            Some(want) => have.as_ref().map(super::Name::as_str) == Some(want.as_str()),
            None => true,
        };
        same(&self.namespace, &record.namespace) && same(&self.service, &record.service)
    }
}

#[derive(Debug)]
pub(super) struct Recent {
    records: Mutex<VecDeque<Arc<Record>>>,
    capacity: usize,
}

impl Recent {
    pub(super) fn new(capacity: usize) -> Recent {
        Recent {
            records: Mutex::new(VecDeque::with_capacity(capacity)),
            capacity,
        }
    }

    pub(super) fn push_all(&self, new: Vec<Arc<Record>>) {
        let mut records = self.records.locked();
        let room = self.capacity.saturating_sub(new.len());
        if records.len() > room {
            let over = records.len() - room;
            records.drain(..over);
        }
        let skip = new.len().saturating_sub(self.capacity);
        records.extend(new.into_iter().skip(skip));
    }

    /// Those `filter` lets through, oldest first.
    pub(super) fn matching(&self, filter: &Filter) -> Vec<Arc<Record>> {
        let records = self.records.locked();
        records
            .iter()
            .filter(|r| filter.matches(r))
            .cloned()
            .collect()
    }
}
