//! CPU masks: a fixed-size bitset with the kernel's cpumask operations.
//!
//! A mask is a plain array of 64 words (4,096 CPUs), so it lives on the
//! stack and copying or combining masks never allocates. The set operations
//! (and, or, andnot, weight, subset and intersection tests) run over all 64
//! words: a fixed-length loop over 512 bytes the compiler vectorises, which
//! costs less than tracking how many words are in use. The walks
//! (`next_lt`, `first_and_and`, the wrap iterator) and the emptiness test
//! stop early, at the first set bit or at the node's CPU count, and
//! `weight_lt`, `and_lt` and `andnot_assign_lt` (a wakeup scan's) touch
//! only a node's words, as the kernel's run over `nr_cpumask_bits`.

use std::fmt;

/// Largest number of CPUs a node may have.
pub const MAX_CPUS: usize = 4096;
const NR_WORDS: usize = MAX_CPUS / 64;

/// A set of CPU ids in `0..MAX_CPUS`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CpuMask {
    words: [u64; NR_WORDS],
}

impl Default for CpuMask {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuMask {
    pub const fn new() -> Self {
        Self {
            words: [0; NR_WORDS],
        }
    }

    /// The mask of CPUs `0..n`.
    pub fn first_n(n: usize) -> Self {
        let mut m = Self::new();
        m.assign_first_n(n);
        m
    }

    /// Makes this the mask of CPUs `0..n`, in place: a task's mask is
    /// rewritten for every request, and a new mask moved in would be a
    /// second 512 bytes to write and copy.
    #[inline]
    pub fn assign_first_n(&mut self, n: usize) {
        let n = n.min(MAX_CPUS);
        let full = n / 64;
        self.words[..full].fill(!0);
        self.words[full..].fill(0);
        if !n.is_multiple_of(64) {
            self.words[full] = (1u64 << (n % 64)) - 1;
        }
    }

    pub fn from_cpus<I: IntoIterator<Item = usize>>(cpus: I) -> Self {
        let mut m = Self::new();
        for c in cpus {
            m.set(c);
        }
        m
    }

    #[inline]
    pub fn set(&mut self, cpu: usize) {
        self.words[cpu / 64] |= 1u64 << (cpu % 64);
    }

    #[inline]
    pub fn clear(&mut self, cpu: usize) {
        self.words[cpu / 64] &= !(1u64 << (cpu % 64));
    }

    /// `cpumask_test_cpu`; ids beyond the mask are simply not set.
    #[inline]
    pub fn test(&self, cpu: usize) -> bool {
        cpu < MAX_CPUS && self.words[cpu / 64] & (1u64 << (cpu % 64)) != 0
    }

    /// `cpumask_empty`: as the kernel's, a search for the first set bit, so
    /// a task's mask (a CPU in its first word) is known non-empty from one
    /// word, not all 64.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.first().is_none()
    }

    /// `cpumask_weight`.
    pub fn weight(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// `cpumask_weight` over the CPUs `< end` only (the kernel's
    /// `nr_cpumask_bits`): a node's masks hold no CPU beyond its own, and a
    /// 128-CPU node's are 2 of the 64 words.
    pub fn weight_lt(&self, end: usize) -> usize {
        let end = end.min(MAX_CPUS);
        let full = end / 64;
        let mut n: usize = self.words[..full]
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum();
        if !end.is_multiple_of(64) {
            n += (self.words[full] & ((1u64 << (end % 64)) - 1)).count_ones() as usize;
        }
        n
    }

    #[inline]
    pub fn and(&self, other: &CpuMask) -> CpuMask {
        let mut r = *self;
        r.and_assign(other);
        r
    }

    #[inline]
    pub fn and_assign(&mut self, other: &CpuMask) {
        for (a, b) in self.words.iter_mut().zip(other.words.iter()) {
            *a &= *b;
        }
    }

    #[inline]
    pub fn or(&self, other: &CpuMask) -> CpuMask {
        let mut r = *self;
        r.or_assign(other);
        r
    }

    #[inline]
    pub fn or_assign(&mut self, other: &CpuMask) {
        for (a, b) in self.words.iter_mut().zip(other.words.iter()) {
            *a |= *b;
        }
    }

    /// `cpumask_andnot`: the CPUs of `self` that are not in `other`.
    #[inline]
    pub fn andnot(&self, other: &CpuMask) -> CpuMask {
        let mut r = *self;
        r.andnot_assign(other);
        r
    }

    #[inline]
    pub fn andnot_assign(&mut self, other: &CpuMask) {
        for (a, b) in self.words.iter_mut().zip(other.words.iter()) {
            *a &= !*b;
        }
    }

    /// `cpumask_and` over the CPUs `< end` only, as the kernel's runs over
    /// `nr_cpumask_bits`: the CPUs of both below `end`. Where `self` is a
    /// node's mask (none of its CPUs at or beyond the node's count, `end`),
    /// this is `and`, reading 2 of the 64 words of a 128-CPU node's masks
    /// instead of all of them: a wakeup's scan starts from one such `and`.
    #[inline]
    pub fn and_lt(&self, other: &CpuMask, end: usize) -> CpuMask {
        let end = end.min(MAX_CPUS);
        let full = end / 64;
        let mut r = CpuMask::new();
        for ((d, a), b) in r.words[..full]
            .iter_mut()
            .zip(&self.words)
            .zip(&other.words)
        {
            *d = a & b;
        }
        if !end.is_multiple_of(64) {
            r.words[full] = self.words[full] & other.words[full] & ((1u64 << (end % 64)) - 1);
        }
        r
    }

    /// `cpumask_andnot` in place over the CPUs `< end` only: the CPUs of
    /// `other` below `end` leave `self`, and the rest of `self` stays.
    /// Where `other` is a node's mask (none of its CPUs at or beyond
    /// `end`), this is `andnot_assign`, reading only the node's words.
    #[inline]
    pub fn andnot_assign_lt(&mut self, other: &CpuMask, end: usize) {
        let end = end.min(MAX_CPUS);
        let full = end / 64;
        for (a, b) in self.words[..full].iter_mut().zip(&other.words) {
            *a &= !*b;
        }
        if !end.is_multiple_of(64) {
            self.words[full] &= !(other.words[full] & ((1u64 << (end % 64)) - 1));
        }
    }

    /// `cpumask_intersects`.
    pub fn intersects(&self, other: &CpuMask) -> bool {
        self.words
            .iter()
            .zip(other.words.iter())
            .any(|(a, b)| a & b != 0)
    }

    /// `cpumask_subset`: every CPU of `self` is in `other`.
    pub fn is_subset(&self, other: &CpuMask) -> bool {
        self.words
            .iter()
            .zip(other.words.iter())
            .all(|(a, b)| a & !b == 0)
    }

    /// `cpumask_first`: the lowest CPU, if any.
    #[inline]
    pub fn first(&self) -> Option<usize> {
        self.next(0)
    }

    /// `cpumask_next` (inclusive): the lowest CPU `>= from`.
    #[inline]
    pub fn next(&self, from: usize) -> Option<usize> {
        if from >= MAX_CPUS {
            return None;
        }
        let mut w = from / 64;
        let mut bits = self.words[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == NR_WORDS {
                return None;
            }
            bits = self.words[w];
        }
    }

    /// `cpumask_next` restricted to CPUs `< end`: stops scanning at the last
    /// word a node of `end` CPUs can use, so walks over small nodes do not pay
    /// for the whole 4,096-bit mask.
    #[inline]
    pub fn next_lt(&self, from: usize, end: usize) -> Option<usize> {
        if from >= end {
            return None;
        }
        let last = (end - 1) / 64;
        let mut w = from / 64;
        let mut bits = self.words[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                let c = w * 64 + bits.trailing_zeros() as usize;
                return (c < end).then_some(c);
            }
            w += 1;
            if w > last {
                return None;
            }
            bits = self.words[w];
        }
    }

    /// `cpumask_first_and`.
    pub fn first_and(&self, b: &CpuMask) -> Option<usize> {
        self.words
            .iter()
            .zip(b.words.iter())
            .enumerate()
            .find_map(|(i, (x, y))| {
                let w = x & y;
                (w != 0).then(|| i * 64 + w.trailing_zeros() as usize)
            })
    }

    /// `cpumask_first_and_and`: the lowest CPU in all three masks, found
    /// word by word without materialising the intersection.
    pub fn first_and_and(&self, b: &CpuMask, c: &CpuMask) -> Option<usize> {
        for i in 0..NR_WORDS {
            let w = self.words[i] & b.words[i] & c.words[i];
            if w != 0 {
                return Some(i * 64 + w.trailing_zeros() as usize);
            }
        }
        None
    }

    /// Ascending iteration over a snapshot of the mask.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            mask: self,
            next: 0,
        }
    }

    /// The words holding the bits, lowest CPUs first.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Parse a cpulist such as `"0-3,8,10-11"`. Every id must be below `nr_cpus`.
    pub fn parse_cpulist(s: &str, nr_cpus: usize) -> Result<CpuMask, String> {
        let mut m = CpuMask::new();
        let s = s.trim();
        if s.is_empty() {
            return Ok(m);
        }
        for part in s.split(',') {
            let part = part.trim();
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (parse_id(a)?, parse_id(b)?),
                None => {
                    let v = parse_id(part)?;
                    (v, v)
                }
            };
            if lo > hi {
                return Err(format!("range {part} is reversed"));
            }
            if hi >= nr_cpus {
                return Err(format!("CPU {hi} is not in the topology"));
            }
            for c in lo..=hi {
                m.set(c);
            }
        }
        Ok(m)
    }
}

fn parse_id(s: &str) -> Result<usize, String> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{} is not a CPU id", crate::quote::quote(s)));
    }
    match s.parse::<usize>() {
        Ok(v) if v < MAX_CPUS => Ok(v),
        // All digits: shown as they are unless too long to echo.
        _ => Err(format!(
            "CPU {} is out of range (max {})",
            crate::quote::field_key(s),
            MAX_CPUS - 1
        )),
    }
}

/// Prints the canonical cpulist: ascending, maximal ranges.
impl fmt::Display for CpuMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut c = self.first();
        while let Some(lo) = c {
            let mut hi = lo;
            while hi + 1 < MAX_CPUS && self.test(hi + 1) {
                hi += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
            c = self.next(hi + 1);
        }
        Ok(())
    }
}

impl fmt::Debug for CpuMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuMask({self})")
    }
}

pub struct Iter<'a> {
    mask: &'a CpuMask,
    next: usize,
}

impl Iterator for Iter<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        let c = self.mask.next(self.next)?;
        self.next = c + 1;
        Some(c)
    }
}

/// `for_each_cpu_wrap` over a mask that may shrink during the walk.
///
/// The CPUs `>= start` come first, then those `< start`; each is visited at
/// most once. The caller passes the mask to every `next` call, so a CPU
/// removed before the walk reaches it is skipped, as the kernel's live walk
/// does (`select_idle_core` relies on this).
pub struct WrapWalk {
    start: usize,
    end: usize,
    pos: usize,
    wrapped: bool,
}

impl WrapWalk {
    /// A walk from `start` over masks whose CPUs are all `< nr_cpus`.
    pub fn new(start: usize, nr_cpus: usize) -> Self {
        let start = if start >= nr_cpus { 0 } else { start };
        Self {
            start,
            end: nr_cpus,
            pos: start,
            wrapped: false,
        }
    }

    #[inline]
    pub fn next(&mut self, mask: &CpuMask) -> Option<usize> {
        if !self.wrapped {
            if let Some(c) = mask.next_lt(self.pos, self.end) {
                self.pos = c + 1;
                return Some(c);
            }
            self.wrapped = true;
            self.pos = 0;
        }
        let c = mask.next_lt(self.pos, self.start)?;
        self.pos = c + 1;
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> CpuMask {
        CpuMask::parse_cpulist(s, MAX_CPUS).unwrap()
    }

    #[test]
    fn cpulist_round_trips_in_canonical_form() {
        assert_eq!(m("0-3,8,10-11").to_string(), "0-3,8,10-11");
        assert_eq!(m("3,2,1,0,9").to_string(), "0-3,9");
        assert_eq!(m("").to_string(), "");
        assert_eq!(m("4095").to_string(), "4095");
        assert_eq!(m("62-65").weight(), 4);
    }

    #[test]
    fn cpulist_rejects_bad_input() {
        assert!(CpuMask::parse_cpulist("5-3", 8).is_err());
        assert!(
            CpuMask::parse_cpulist("8", 8)
                .unwrap_err()
                .contains("CPU 8")
        );
        assert!(CpuMask::parse_cpulist("a", 8).is_err());
        assert!(CpuMask::parse_cpulist("1,,2", 8).is_err());
        assert!(CpuMask::parse_cpulist("-1", 8).is_err());
        assert!(CpuMask::parse_cpulist("99999", 8).is_err());
    }

    #[test]
    fn set_operations_match_their_definitions() {
        let a = m("0-7,64-70");
        let b = m("4-65");
        assert_eq!(a.and(&b).to_string(), "4-7,64-65");
        assert_eq!(a.or(&b).to_string(), "0-70");
        assert_eq!(a.andnot(&b).to_string(), "0-3,66-70");
        assert!(m("4-5").is_subset(&a));
        assert!(!b.is_subset(&a));
        assert!(a.intersects(&b));
        assert!(!m("8-9").intersects(&a));
        assert_eq!(a.weight(), 15);
        assert_eq!(CpuMask::first_n(70).to_string(), "0-69");
        assert_eq!(CpuMask::first_n(64).to_string(), "0-63");
    }

    #[test]
    fn weight_lt_counts_only_the_cpus_below_its_end() {
        let a = m("0-3,63,64,100,4000");
        assert_eq!(a.weight_lt(4), 4);
        assert_eq!(a.weight_lt(64), 5, "63 is below 64");
        assert_eq!(a.weight_lt(65), 6, "64 starts the second word");
        assert_eq!(a.weight_lt(128), 7);
        assert_eq!(a.weight_lt(MAX_CPUS), a.weight());
        assert_eq!(
            a.weight_lt(1 << 20),
            a.weight(),
            "an end past the mask is the mask's"
        );
        assert_eq!(a.weight_lt(0), 0);
    }

    #[test]
    fn the_bounded_and_and_andnot_see_only_the_cpus_below_their_end() {
        let a = m("0-7,63-70,200,4095");
        let b = m("4-65,200,4095");
        assert_eq!(a.and_lt(&b, 65).to_string(), "4-7,63-64");
        assert_eq!(
            a.and_lt(&b, 64).to_string(),
            "4-7,63",
            "64 starts the second word"
        );
        assert_eq!(a.and_lt(&b, 0).to_string(), "");
        assert_eq!(a.and_lt(&b, MAX_CPUS), a.and(&b));
        assert_eq!(a.and_lt(&b, 1 << 20), a.and(&b), "an end past the mask");
        let mut c = a;
        c.andnot_assign_lt(&b, 65);
        assert_eq!(c.to_string(), "0-3,65-70,200,4095", "beyond 65 stays");
        let mut c = a;
        c.andnot_assign_lt(&b, 0);
        assert_eq!(c, a, "nothing below 0");
        let mut c = a;
        c.andnot_assign_lt(&b, MAX_CPUS);
        assert_eq!(c, a.andnot(&b));
        // A node's masks hold no CPU at or beyond its count: for them the
        // bounded forms are the full ones.
        let (span, other) = (m("0-127"), m("1,3,64-90"));
        assert_eq!(span.and_lt(&other, 128), span.and(&other));
        let mut c = span;
        c.andnot_assign_lt(&other, 128);
        assert_eq!(c, span.andnot(&other));
    }

    #[test]
    fn assign_first_n_clears_what_was_there() {
        let mut a = m("5,70,4095");
        a.assign_first_n(65);
        assert_eq!(a, CpuMask::first_n(65));
        assert_eq!(a.weight(), 65);
        assert!(a.test(64) && !a.test(65) && !a.test(4095));
        a.assign_first_n(0);
        assert!(a.is_empty());
        a.assign_first_n(MAX_CPUS + 7);
        assert_eq!(a.weight(), MAX_CPUS);
    }

    #[test]
    fn is_empty_looks_past_the_first_words() {
        assert!(CpuMask::new().is_empty());
        assert!(!m("4095").is_empty(), "the last CPU alone");
        assert!(!m("0").is_empty());
    }

    #[test]
    fn first_next_and_first_and_and() {
        let a = m("3,100,4000");
        assert_eq!(a.first(), Some(3));
        assert_eq!(a.next(4), Some(100));
        assert_eq!(a.next(4001), None);
        assert_eq!(a.next_lt(4, 100), None);
        assert_eq!(a.next_lt(4, 101), Some(100));
        assert_eq!(a.next_lt(101, 4096), Some(4000));
        assert_eq!(CpuMask::new().first(), None);
        let b = m("100-200,4000");
        let c = m("150-4095");
        assert_eq!(a.first_and(&b), Some(100));
        assert_eq!(a.first_and_and(&b, &c), Some(4000));
        assert_eq!(a.first_and_and(&b, &m("0-99")), None);
    }

    #[test]
    fn wrap_walk_starts_at_start_and_visits_each_once() {
        let s = m("0-7");
        let mut w = WrapWalk::new(5, 8);
        let mut seen = vec![];
        while let Some(c) = w.next(&s) {
            seen.push(c);
        }
        assert_eq!(seen, vec![5, 6, 7, 0, 1, 2, 3, 4]);
        // start beyond the mask: plain ascending
        let mut w = WrapWalk::new(8, 8);
        let mut seen = vec![];
        while let Some(c) = w.next(&s) {
            seen.push(c);
        }
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn wrap_walk_reads_the_mask_live() {
        let mut s = m("0-7");
        let mut w = WrapWalk::new(2, 8);
        let mut seen = vec![];
        while let Some(c) = w.next(&s) {
            seen.push(c);
            if c == 2 {
                s.clear(6);
                s.clear(0);
            }
        }
        assert_eq!(seen, vec![2, 3, 4, 5, 7, 1]);
    }

    #[test]
    fn wrap_walk_of_empty_mask_visits_nothing() {
        let mut w = WrapWalk::new(0, 8);
        assert_eq!(w.next(&CpuMask::new()), None);
    }
}
