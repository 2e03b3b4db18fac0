//! The series recorded on every placement decision, kept in fixed atomic
//! tables and rendered at scrape time.
//!
//! A decision is the server's hottest path: hundreds of thousands a second
//! on PickCpus streams. The recorder's histograms queue every sample (its
//! value and a timestamp) until the next upkeep drains them: a lock-free
//! queue push per sample, memory that grows with the decision rate between
//! two upkeeps (tens of MB at that rate), and the drain's work on an async
//! worker. Here a decision costs a bucket search and a few relaxed atomic
//! adds, the memory is fixed (a few KiB), and the scrape does the
//! cumulative sums. The series, their labels and their buckets are the
//! same as the recorder's would be, and a (kind, path) pair that never
//! occurred has none.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::engine::decision::{Kind, Path};

use super::{AGE_BUCKETS, LATENCY_BUCKETS, SCANNED_BUCKETS};

/// A Prometheus histogram over the fixed upper bounds `bounds` (ascending).
pub struct FixedHistogram<const N: usize> {
    bounds: &'static [f64; N],
    /// `counts[i]`: the samples in (`bounds[i-1]`, `bounds[i]`]; not
    /// cumulative, so a sample touches one of them.
    counts: [AtomicU64; N],
    /// The samples above the last bound (and any NaN).
    over: AtomicU64,
    /// The samples' sum, as `f64` bits.
    sum: AtomicU64,
}

/// What a scrape reads of a histogram: cumulative counts per bound, the
/// count (the `+Inf` bucket) and the sum.
struct Reading<const N: usize> {
    cumulative: [u64; N],
    count: u64,
    sum: f64,
}

impl<const N: usize> FixedHistogram<N> {
    pub const fn new(bounds: &'static [f64; N]) -> Self {
        Self {
            bounds,
            counts: [const { AtomicU64::new(0) }; N],
            over: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    pub fn record(&self, v: f64) {
        // The first bound not below v: the `le` bucket v falls in.
        let i = self.bounds.partition_point(|b| *b < v);
        match self.counts.get(i) {
            Some(c) if !v.is_nan() => c.fetch_add(1, Relaxed),
            _ => self.over.fetch_add(1, Relaxed),
        };
        let _ = self.sum.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// Each counter is read once, and the count is their total, so the
    /// buckets a scrape shows are monotonic and end at the count even while
    /// decisions are recorded.
    fn read(&self) -> Reading<N> {
        let mut cumulative = [0; N];
        let mut count = 0;
        for (c, slot) in self.counts.iter().zip(&mut cumulative) {
            count += c.load(Relaxed);
            *slot = count;
        }
        count += self.over.load(Relaxed);
        let sum = f64::from_bits(self.sum.load(Relaxed));
        Reading {
            cumulative,
            count,
            sum,
        }
    }

    /// Writes the series of `name` with `labels` (`k="v",...`, or empty):
    /// its buckets, sum and count; nothing if it has no sample. Returns
    /// the count.
    fn render(&self, name: &str, labels: &str, out: &mut String) -> u64 {
        let r = self.read();
        if r.count == 0 {
            return 0;
        }
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(r.cumulative) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", r.count);
        let braced = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braced} {}", r.sum);
        let _ = writeln!(out, "{name}_count{braced} {}", r.count);
        r.count
    }
}

const NR_KINDS: usize = Kind::ALL.len();
const NR_PATHS: usize = Path::ALL.len();

/// CPUs scanned, by (kind, path); its counts are also the decision counter.
static SCANNED: [[FixedHistogram<{ SCANNED_BUCKETS.len() }>; NR_PATHS]; NR_KINDS] =
    [const { [const { FixedHistogram::new(&SCANNED_BUCKETS) }; NR_PATHS] }; NR_KINDS];
/// The engine's time per decision, by kind.
static DURATION: [FixedHistogram<{ LATENCY_BUCKETS.len() }>; NR_KINDS] =
    [const { FixedHistogram::new(&LATENCY_BUCKETS) }; NR_KINDS];
/// The age of the state decisions read.
static STATE_AGE: FixedHistogram<{ AGE_BUCKETS.len() }> = FixedHistogram::new(&AGE_BUCKETS);

/// One placement decision: counted by kind and path, with the CPUs it
/// scanned, how long it took (s) and the age of the state it read (s).
pub fn record(kind: Kind, path: Path, scanned: u32, took: f64, age: f64) {
    SCANNED[kind as usize][path as usize].record(scanned as f64);
    DURATION[kind as usize].record(took);
    STATE_AGE.record(age);
}

/// Writes the decision families (the counter and the three histograms),
/// each with its HELP and TYPE lines.
pub fn render(out: &mut String) {
    let mut counts = String::new();
    let mut scanned = String::new();
    for kind in Kind::ALL {
        for path in Path::ALL {
            let labels = format!("kind=\"{}\",path=\"{}\"", kind.as_str(), path.as_str());
            let h = &SCANNED[kind as usize][path as usize];
            let n = h.render(super::DECISION_SCANNED, &labels, &mut scanned);
            if n > 0 {
                let _ = writeln!(counts, "{}{{{labels}}} {n}", super::DECISIONS);
            }
        }
    }
    let mut duration = String::new();
    for kind in Kind::ALL {
        let labels = format!("kind=\"{}\"", kind.as_str());
        DURATION[kind as usize].render(super::DECISION_DURATION, &labels, &mut duration);
    }
    let mut age = String::new();
    STATE_AGE.render(super::DECISION_STATE_AGE, "", &mut age);
    for (name, samples) in [
        (super::DECISIONS, counts),
        (super::DECISION_SCANNED, scanned),
        (super::DECISION_DURATION, duration),
        (super::DECISION_STATE_AGE, age),
    ] {
        super::write_family(out, name, &samples);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static B: [f64; 3] = [0.0, 1.0, 4.0];

    fn lines(h: &FixedHistogram<3>, labels: &str) -> Vec<String> {
        let mut out = String::new();
        h.render("h", labels, &mut out);
        out.lines().map(str::to_string).collect()
    }

    #[test]
    fn a_sample_counts_in_every_bucket_whose_bound_it_does_not_exceed() {
        let h = FixedHistogram::new(&B);
        for v in [0.0, 1.0, 1.5, 4.0, 9.0] {
            h.record(v);
        }
        assert_eq!(
            lines(&h, "k=\"v\""),
            [
                "h_bucket{k=\"v\",le=\"0\"} 1",
                "h_bucket{k=\"v\",le=\"1\"} 2",
                "h_bucket{k=\"v\",le=\"4\"} 4",
                "h_bucket{k=\"v\",le=\"+Inf\"} 5",
                "h_sum{k=\"v\"} 15.5",
                "h_count{k=\"v\"} 5",
            ]
        );
    }

    #[test]
    fn an_unlabelled_series_has_no_braces_but_le_and_nan_counts_only_in_inf() {
        let h = FixedHistogram::new(&B);
        h.record(0.5);
        h.record(f64::NAN);
        let l = lines(&h, "");
        assert_eq!(l[0], "h_bucket{le=\"0\"} 0");
        assert_eq!(l[1], "h_bucket{le=\"1\"} 1");
        assert_eq!(l[3], "h_bucket{le=\"+Inf\"} 2");
        assert_eq!(l[5], "h_count 2");
        assert!(l[4].starts_with("h_sum "), "{l:?}");
    }

    #[test]
    fn a_histogram_with_no_sample_has_no_series() {
        assert!(lines(&FixedHistogram::new(&B), "k=\"v\"").is_empty());
    }

    #[test]
    fn the_decision_counter_is_the_count_of_its_scanned_histogram() {
        // The tables are process-wide: read before and after, and compare
        // the difference, so other tests' decisions do not matter.
        let count = |out: &str, series: &str| -> u64 {
            out.lines()
                .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
                .unwrap_or(0)
        };
        let counter = "fairplace_decisions_total{kind=\"exec\",path=\"exec_stay_inactive\"}";
        let hist =
            "fairplace_decision_scanned_cpus_count{kind=\"exec\",path=\"exec_stay_inactive\"}";
        let mut before = String::new();
        render(&mut before);
        record(Kind::Exec, Path::ExecStayInactive, 3, 1e-6, 0.01);
        let mut after = String::new();
        render(&mut after);
        assert!(count(&after, counter) > count(&before, counter), "{after}");
        assert_eq!(count(&after, counter), count(&after, hist));
        assert!(after.contains("# TYPE fairplace_decision_scanned_cpus histogram"));
        assert!(after.contains("# TYPE fairplace_decisions_total counter"));
    }
}
