//! A model of a BPF LPM trie: keys are 24 bytes compared most significant bit first, and a lookup
//! returns the value of the longest stored prefix containing the key.
use std::collections::{BTreeMap, HashMap};

use redirect_common::fastpath::{AddrKey, LpmBytes};

#[derive(Debug, Clone, PartialEq)]
pub(super) struct LpmTrie<V> {
    /// Prefix length -> masked key -> value.
    by_len: BTreeMap<u32, HashMap<LpmBytes, V>>,
    len: usize,
}

impl<V> Default for LpmTrie<V> {
    fn default() -> Self {
        LpmTrie {
            by_len: BTreeMap::new(),
            len: 0,
        }
    }
}

/// The first `prefix_len` bits of `bytes`, the rest zero.
pub(super) fn mask(bytes: LpmBytes, prefix_len: u32) -> LpmBytes {
    let mut out = [0; 24];
    for (i, b) in bytes.iter().enumerate() {
        let bits = prefix_len.saturating_sub(i as u32 * 8).min(8);
        out[i] = if bits == 0 {
            0
        } else {
            b & (0xff << (8 - bits))
        };
    }
    out
}

impl<V> LpmTrie<V> {
    /// Stores `value` for the first `prefix_len` bits of `key` (replacing an equal prefix).
    pub(super) fn insert(&mut self, key: AddrKey, prefix_len: u32, value: V) {
        let bucket = self.by_len.entry(prefix_len).or_default();
        if bucket
            .insert(mask(key.lpm_bytes(), prefix_len), value)
            .is_none()
        {
            self.len += 1;
        }
    }

    pub(super) fn lookup(&self, key: AddrKey) -> Option<&V> {
        let bytes = key.lpm_bytes();
        self.by_len
            .iter()
            .rev()
            .find_map(|(len, bucket)| bucket.get(&mask(bytes, *len)))
    }

    /// The value stored for exactly this prefix (`bytes` masked to `prefix_len`, as [`Self::iter`]
    /// gives them).
    pub(super) fn get(&self, prefix_len: u32, bytes: &LpmBytes) -> Option<&V> {
        self.by_len.get(&prefix_len)?.get(bytes)
    }

    /// Every stored prefix: (prefix length, masked key bytes, value).
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &LpmBytes, &V)> {
        self.by_len
            .iter()
            .flat_map(|(len, bucket)| bucket.iter().map(move |(key, v)| (*len, key, v)))
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}
