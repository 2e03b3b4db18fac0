//! The bounds a node's report must keep. The server refuses what breaks
//! them (naming the field); the agent trims its reports to them, so the two
//! read the same constants.

/// The largest value a PELT signal or a task count may carry (`i32`):
/// the one bound every input path checks.
pub const MAX_SIGNAL: i64 = (1 << 31) - 1;

/// The largest clock value (ns) an input may carry: 2^62, so differences
/// of two clocks never overflow.
pub const MAX_CLOCK: i64 = 1 << 62;

/// Tasks a CPU may list: more than any runqueue the balancer could use
/// (it looks at 32 per pass), few enough to bound a node's memory.
pub const MAX_TASKS_PER_CPU: usize = 1024;
/// Runtime one report may add on one CPU: 1,000 s.
pub const MAX_RUNTIME_NS: u64 = 1_000_000_000_000;
/// Tasks a node may list in all, and distinct affinity masks it may use.
pub const MAX_TASKS_PER_NODE: usize = 65_536;
pub const MAX_MASKS_PER_NODE: usize = 4_096;
/// Runtime entries one update may carry, per CPU of the node.
///
/// An entry is one process's runtime on one CPU since the previous report,
/// so a real machine sends one per (process, CPU) pair that ran in the
/// interval: a dozen processes waking every few milliseconds on a 2-CPU
/// machine already make 16 to 24. With 64 per CPU, an agent that keeps the
/// biggest entries drops only entries of at most 1/64 of a CPU over the
/// interval (64 x CPUs bigger ones would use more time than the node has),
/// which matter little for cache-aware accounting. The bound
/// stays linear in the node's CPUs, like the task limits: each entry costs
/// one hash update in `account_mm_sched` (and at most one LLC scan per
/// process per 10 ms epoch), and at `MAX_CPUS` the largest list is 262,144
/// entries, about 6 MB decoded, the same order as `MAX_TASKS_PER_NODE`
/// tasks.
pub const MAX_RUNTIME_PER_CPU: usize = 64;
