//! The build's hashing: a fast hasher for its maps (the spans' hashes and
//! small integer keys) and a mask's hash from its non-zero words.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::*;

/// A fast hasher for the build's maps (spans' hashes, small integer keys):
/// FxHash's rounds with a final mix. Inputs are the node's own topology, so
/// no flooding defence is needed.
#[derive(Default)]
pub(super) struct FastHasher(u64);

pub(super) const FX_K: u64 = 0x517c_c1b7_2722_0a95;

impl FastHasher {
    #[inline]
    pub(super) fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(FX_K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.add(b as u64);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    fn write_u16(&mut self, i: u16) {
        self.add(i as u64);
    }
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        fmix64(self.0)
    }
}

/// MurmurHash3's finaliser.
pub(super) fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

pub(super) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A mask's hash from its non-zero words only, so a sparse 4,096-bit mask
/// costs a scan and a few rounds.
pub(super) fn mask_hash(m: &CpuMask) -> u64 {
    let mut h = FastHasher::default();
    for (i, &w) in m.words().iter().enumerate() {
        if w != 0 {
            h.add(i as u64);
            h.add(w);
        }
    }
    h.finish()
}
