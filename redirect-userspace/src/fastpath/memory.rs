//! What the fast path's tables take in the kernel, worked out ahead (the budget the compiler keeps
//! to) and read back (what `/config_dump` and the metrics show).
//!
//! An entry of a hash map is one allocation holding the element header, the key and the value
//! (each rounded up to 8 bytes), from the kernel's size classes; the map also holds one 16-byte
//! bucket per slot of its capacity (a power of two). An LPM trie node holds its header, key bytes
//! and value, and the trie may hold one inner node per entry beside it. These are estimates: the
//! kernel rounds its allocations its own way, and says what a map takes (`memlock`) only on recent
//! kernels.

/// Bytes of a hash map element's header (`struct htab_elem`).
const HTAB_ELEM: usize = 48;
/// Bytes of one hash bucket.
const BUCKET: usize = 16;
/// Bytes of an LPM trie node's header (`struct lpm_trie_node`).
const LPM_NODE: usize = 40;

/// The kernel's allocation size classes up to a page: an allocation takes the first that holds it.
fn size_class(bytes: usize) -> usize {
    const CLASSES: [usize; 11] = [8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048];
    CLASSES
        .into_iter()
        .find(|&c| c >= bytes)
        .unwrap_or(bytes.next_multiple_of(4096))
}

const fn round8(n: usize) -> usize {
    n.next_multiple_of(8)
}

/// Bytes one entry of `table` takes, beside the buckets.
pub(super) fn entry_bytes(table: &str) -> usize {
    use core::mem::size_of;

    use redirect_common::fastpath::{AddrKey, Backends, Claim, IpKey, LpmBytes, PortKey};
    let hash = |key: usize, value: usize| size_class(HTAB_ELEM + round8(key) + round8(value));
    match table {
        "clients" => hash(size_of::<u64>(), size_of::<u32>()),
        "exact" => hash(size_of::<AddrKey>(), size_of::<Claim>()),
        "ports" => hash(size_of::<PortKey>(), size_of::<Backends>()),
        "workloads" => hash(size_of::<IpKey>(), size_of::<u8>()),
        // A leaf, and at most one inner node (no value) beside it.
        "cidrs" => {
            let key = size_of::<LpmBytes>();
            size_class(LPM_NODE + key + size_of::<Claim>()) + size_class(LPM_NODE + key)
        }
        _ => 0,
    }
}

/// What a map of `table` holding `entries` in room for `capacity` takes, estimated.
pub(crate) fn kernel_bytes(table: &str, entries: usize, capacity: usize) -> u64 {
    let buckets = match table {
        "cidrs" => 0,
        _ => capacity.next_power_of_two() * BUCKET,
    };
    (entries * entry_bytes(table) + buckets) as u64
}

/// What one table's maps take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TableMemory {
    pub entries: usize,
    /// The entries the maps were created for.
    pub capacity: usize,
    pub estimated_bytes: u64,
    /// What the kernel says the maps take, where it says (`memlock`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_bytes: Option<u64>,
}

impl TableMemory {
    /// Adds another map of the same table (the other generation).
    pub(crate) fn add(&mut self, other: &TableMemory) {
        self.entries += other.entries;
        self.capacity += other.capacity;
        self.estimated_bytes += other.estimated_bytes;
        self.kernel_bytes = match (self.kernel_bytes, other.kernel_bytes) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_take_their_size_class_and_buckets_their_capacity() {
        // 48 + 24 + 16 = 88 bytes: the 96-byte class.
        assert_eq!(entry_bytes("exact"), 96);
        // 48 + 8 + 328 = 384: the 512-byte class.
        assert_eq!(entry_bytes("ports"), 512);
        assert_eq!(entry_bytes("clients"), 64);
        assert_eq!(kernel_bytes("exact", 10, 1000), 10 * 96 + 1024 * 16);
        assert_eq!(kernel_bytes("cidrs", 2, 1024), 2 * (96 + 64));
        let mut both = TableMemory {
            entries: 1,
            capacity: 1024,
            estimated_bytes: 100,
            kernel_bytes: Some(10),
        };
        both.add(&TableMemory {
            kernel_bytes: None,
            ..both
        });
        assert_eq!((both.entries, both.estimated_bytes), (2, 200));
        assert_eq!(both.kernel_bytes, Some(10));
    }
}
