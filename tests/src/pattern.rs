//! Deterministic test bytes, the same in every process: a xorshift stream, so a reordered, dropped or
//! duplicated chunk changes the checksum (a repeating pattern could hide that).
use sha2::{Digest, Sha256};

/// An endless deterministic byte stream.
pub struct Pattern {
    state: u64,
    pending: [u8; 8],
    used: usize,
}

impl Default for Pattern {
    fn default() -> Self {
        Pattern {
            state: 0x9E37_79B9_7F4A_7C15,
            pending: [0; 8],
            used: 8,
        }
    }
}

impl Pattern {
    pub fn new() -> Pattern {
        Pattern::default()
    }

    fn next_word(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x
    }

    /// Fills `buf` with the next bytes of the stream.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut i = 0;
        while i < buf.len() && self.used < 8 {
            buf[i] = self.pending[self.used];
            self.used += 1;
            i += 1;
        }
        let mut words = buf[i..].chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&self.next_word().to_le_bytes());
        }
        let tail = words.into_remainder();
        if !tail.is_empty() {
            self.pending = self.next_word().to_le_bytes();
            self.used = tail.len();
            tail.copy_from_slice(&self.pending[..tail.len()]);
        }
    }
}

/// The first `len` bytes of the stream.
pub fn bytes(len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    Pattern::new().fill(&mut v);
    v
}

/// Hex sha256 of the first `len` bytes of the stream, computed in chunks (no `len`-sized buffer).
pub fn sha256_of_len(len: u64) -> String {
    let mut p = Pattern::new();
    let mut h = Sha256::new();
    let mut buf = vec![0; 1 << 16];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        p.fill(&mut buf[..n]);
        h.update(&buf[..n]);
        left -= n as u64;
    }
    hex(&h.finalize())
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_does_not_change_the_stream() {
        let whole = bytes(1000);
        let mut p = Pattern::new();
        let mut pieces = Vec::new();
        for n in [1, 3, 8, 13, 0, 100, 875] {
            let mut b = vec![0; n];
            p.fill(&mut b);
            pieces.extend(b);
        }
        assert_eq!(pieces, whole);
    }

    #[test]
    fn streamed_checksum_matches_the_buffered_one() {
        let n = (1 << 16) * 2 + 5;
        assert_eq!(sha256_of_len(n as u64), sha256_hex(&bytes(n)));
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn the_stream_does_not_repeat_at_chunk_sizes() {
        let b = bytes(1 << 17);
        assert_ne!(b[..1 << 16], b[1 << 16..]);
        assert_ne!(b[..4096], b[4096..8192]);
    }
}
