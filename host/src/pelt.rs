//! A user-space estimate of the kernel's per-CPU PELT `util_avg`.
//!
//! The server compares CPUs the way the scheduler does, so we want the
//! scheduler's own utilisation signal. The kernel does not export per-CPU
//! `util_avg` outside debugfs, but it does export busy time (`/proc/stat`),
//! and PELT is a fixed linear filter over "was the CPU running": feeding it
//! the same input reproduces the signal, up to what sampling loses.
//!
//! PELT's definition: time is cut into 1024 µs periods; each period's running
//! fraction is added to a sum that is multiplied by `y` every period, with
//! `y^32 = 1/2` (a 32-period ≈ 33 ms half-life); `util_avg` is that sum
//! normalised so that an always-running CPU reads 1024.
//!
//! Sampling only tells us *how much* of an interval was busy, not *when*, so
//! we assume the busy time was spread uniformly over the interval. For an
//! interval of `n` periods (`n` real, so partial periods are exact) with
//! running fraction `f` that gives the closed form
//!
//! ```text
//! util' = util · yⁿ + 1024 · f · (1 − yⁿ)
//! ```
//!
//! which is the continuous-time limit of PELT. It has the property that
//! matters for a sampler: splitting an interval into pieces with the same
//! `f` yields the same result, so the estimate does not depend on the
//! sampling rate. Where the busy time really sat inside the interval (all at
//! the start vs. all at the end) the kernel's value can differ from ours by
//! up to `1024 · (1 − yⁿ)` at the instant of the sample; keeping intervals
//! short (a few ms) keeps that small.

/// One PELT period, in ns (the kernel uses 1024 µs, not 1 ms).
const PERIOD_NS: f64 = 1_024_000.0;
/// `y^HALF_LIFE = 1/2`.
const HALF_LIFE_PERIODS: f64 = 32.0;
/// The kernel's LOAD_AVG_MAX_N: after this many periods a full history has
/// decayed below one unit of util, so we drop it exactly instead of carrying
/// a residue the kernel would not have.
const FULL_DECAY_PERIODS: f64 = 345.0;
/// util_avg of a CPU that is always running.
const UTIL_MAX: f64 = 1024.0;

/// PELT utilisation state of one CPU.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pelt {
    /// Kept as a real number so that many small updates do not accumulate
    /// rounding error; only the public accessors round.
    util: f64,
}

impl Pelt {
    /// A CPU with no history, i.e. idle (the kernel starts at 0 too).
    pub fn new() -> Self {
        Pelt { util: 0.0 }
    }

    /// Folds in one sampling interval: `busy_ns` of running within
    /// `elapsed_ns` of wall time, and returns the new `util_avg`.
    ///
    /// `elapsed_ns == 0` leaves the state unchanged (two samples at the same
    /// instant carry no information). `busy_ns > elapsed_ns` is clamped to a
    /// fully busy interval: `/proc/stat` is tick-granular, so busy time can
    /// overshoot the wall-clock delta by a tick.
    pub fn update(&mut self, busy_ns: u64, elapsed_ns: u64) -> u32 {
        if elapsed_ns == 0 {
            return self.util();
        }
        let f = (busy_ns as f64 / elapsed_ns as f64).min(1.0);
        let n = elapsed_ns as f64 / PERIOD_NS;
        let (keep, gain) = if n > FULL_DECAY_PERIODS {
            (0.0, 1.0)
        } else {
            // ln(yⁿ) = −n·ln2/32. exp_m1 keeps 1 − yⁿ accurate when the
            // interval is tiny and yⁿ is within rounding of 1.
            let ln_keep = -n * std::f64::consts::LN_2 / HALF_LIFE_PERIODS;
            (ln_keep.exp(), -ln_keep.exp_m1())
        };
        self.util = (self.util * keep + UTIL_MAX * f * gain).clamp(0.0, UTIL_MAX);
        self.util()
    }

    /// Current `util_avg`, 0..=1024.
    ///
    /// Rounded to nearest rather than truncated like the kernel: our input
    /// is already an approximation, and truncation would keep a CPU that has
    /// been 100 % busy for seconds at 1023 forever.
    pub fn util(&self) -> u32 {
        self.util.round() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const PERIOD: u64 = 1_024_000;

    /// Runs `steps` intervals of `step_ns`, each `busy_pct` % busy.
    fn run(p: &mut Pelt, busy_pct: u64, step_ns: u64, steps: u64) -> u32 {
        let mut u = p.util();
        for _ in 0..steps {
            u = p.update(step_ns * busy_pct / 100, step_ns);
        }
        u
    }

    fn saturated() -> Pelt {
        let mut p = Pelt::new();
        p.update(400 * MS, 400 * MS);
        assert_eq!(p.util(), 1024);
        p
    }

    #[test]
    fn starts_idle() {
        assert_eq!(Pelt::new().util(), 0);
        assert_eq!(Pelt::default(), Pelt::new());
    }

    #[test]
    fn zero_elapsed_is_a_no_op() {
        let mut p = Pelt::new();
        p.update(3 * MS, 10 * MS);
        let before = p;
        assert_eq!(p.update(0, 0), before.util());
        assert_eq!(
            p.update(5 * MS, 0),
            before.util(),
            "busy without elapsed ignored"
        );
        assert_eq!(p, before);
    }

    #[test]
    fn full_busy_converges_to_1024() {
        let mut p = Pelt::new();
        // 1 ms samples for 350 ms: never a single interval long enough to
        // trigger the full-decay shortcut.
        let u = run(&mut p, 100, MS, 350);
        assert!(u >= 1023, "got {u}");
        let u = run(&mut p, 100, MS, 1000);
        assert_eq!(u, 1024);
    }

    #[test]
    fn half_busy_converges_to_512() {
        let mut p = Pelt::new();
        assert_eq!(run(&mut p, 50, 4 * MS, 200), 512);
        // From the other side too.
        let mut p = saturated();
        assert_eq!(run(&mut p, 50, 4 * MS, 200), 512);
    }

    #[test]
    fn half_life_decay() {
        // Exactly 32 periods halves the signal.
        let mut p = saturated();
        assert_eq!(p.update(0, 32 * PERIOD), 512);
        // 32 ms is 31.25 periods: 1024 · 2^(−31.25/32) ≈ 520.
        let mut p = saturated();
        let u = run(&mut p, 0, MS, 32);
        assert!((u as i64 - 512).abs() <= 10, "got {u}");
        assert_eq!(u, (1024.0 * 0.5f64.powf(31.25 / 32.0)).round() as u32);
    }

    #[test]
    fn step_up_reaches_half_after_half_life() {
        let mut p = Pelt::new();
        assert_eq!(p.update(32 * PERIOD, 32 * PERIOD), 512);
        let mut p = Pelt::new();
        let u = run(&mut p, 100, MS, 32);
        assert!((u as i64 - 512).abs() <= 10, "got {u}");
        assert_eq!(
            u,
            (1024.0 * (1.0 - 0.5f64.powf(31.25 / 32.0))).round() as u32
        );
    }

    #[test]
    fn busy_beyond_elapsed_clamps() {
        let mut a = Pelt::new();
        let mut b = Pelt::new();
        a.update(20 * MS, 10 * MS);
        b.update(10 * MS, 10 * MS);
        assert_eq!(a, b);
        let mut c = Pelt::new();
        assert_eq!(c.update(u64::MAX, 1), c.util());
        assert!(c.util() <= 1024);
    }

    #[test]
    fn long_interval_forgets_history() {
        for start in [Pelt::new(), saturated()] {
            let mut p = start;
            p.update(250 * MS, 1000 * MS);
            assert_eq!(p.util, 256.0, "old state fully decayed, exactly f·1024");
        }
        // Just below the threshold the old state still contributes (< 1 unit).
        let mut p = saturated();
        p.update(0, 345 * PERIOD);
        assert!(p.util > 0.0 && p.util < 1.0);
    }

    #[test]
    fn partial_periods_are_exact() {
        let mut p = saturated();
        p.update(0, PERIOD / 2);
        let expect = 1024.0 * 0.5f64.powf(0.5 / 32.0);
        assert!((p.util - expect).abs() < 1e-9, "{} vs {expect}", p.util);
    }

    /// The estimate must not depend on how often we sample.
    #[test]
    fn splitting_an_interval_changes_nothing() {
        let mut whole = Pelt::new();
        whole.update(3 * MS, 10 * MS);
        whole.update(70 * MS, 100 * MS);
        let mut split = Pelt::new();
        for _ in 0..10 {
            split.update(300_000, MS);
        }
        for _ in 0..1000 {
            split.update(70_000, 100_000);
        }
        assert!(
            (whole.util - split.util).abs() < 1e-6,
            "{} vs {}",
            whole.util,
            split.util
        );
    }

    #[test]
    fn tiny_intervals_do_not_lose_precision() {
        let mut p = Pelt::new();
        for _ in 0..1_000_000 {
            p.update(1, 1); // 1 ns, fully busy
        }
        // 1 ms total = 0.9765625 periods.
        let expect = 1024.0 * (1.0 - 0.5f64.powf(0.9765625 / 32.0));
        assert!((p.util - expect).abs() < 1e-6, "{} vs {expect}", p.util);
    }

    #[test]
    fn stays_in_range_under_arbitrary_input() {
        let mut p = Pelt::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..10_000 {
            // xorshift: deterministic pseudo-random intervals and busy times
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let elapsed = x % (500 * MS);
            let busy = (x >> 20) % (600 * MS);
            let u = p.update(busy, elapsed);
            assert!(u <= 1024);
            assert!((0.0..=1024.0).contains(&p.util));
        }
    }

    #[test]
    fn monotone_towards_target() {
        let mut p = Pelt::new();
        let mut last = 0;
        for _ in 0..100 {
            let u = p.update(3 * MS, 4 * MS); // target 768
            assert!(u >= last && u <= 768);
            last = u;
        }
        assert_eq!(last, 768);
    }
}
