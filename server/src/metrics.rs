//! Prometheus metrics: names, help text and buckets, recorded at the edges
//! (service and store) from what the engine returns. A leaf: what serves
//! them (`exposition`) and what records them import this, not the reverse.

mod decisions;

use std::fmt::Write as _;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const DECISIONS: &str = "fairplace_decisions_total";
pub const DECISION_SCANNED: &str = "fairplace_decision_scanned_cpus";
pub const DECISION_DURATION: &str = "fairplace_decision_duration_seconds";
pub const DECISION_STATE_AGE: &str = "fairplace_decision_state_age_seconds";
pub const MIGRATE_CHECKS: &str = "fairplace_can_migrate_total";
pub const RPC_REQUESTS: &str = "fairplace_rpc_requests_total";
pub const RPC_DURATION: &str = "fairplace_rpc_duration_seconds";
pub const RPC_SHED: &str = "fairplace_rpc_load_shed_total";
pub const NODES: &str = "fairplace_nodes";
pub const REPORTS_APPLIED: &str = "fairplace_agent_reports_applied_total";
pub const REPORTS_REJECTED: &str = "fairplace_agent_reports_rejected_total";
pub const CPU_UPDATES: &str = "fairplace_agent_cpu_updates_total";
pub const REPORT_APPLY_DURATION: &str = "fairplace_report_apply_duration_seconds";
pub const CLAIMS_OUTSTANDING: &str = "fairplace_claims_outstanding";
pub const CLAIMS_EXPIRED: &str = "fairplace_claims_expired_total";
pub const CLAIM_RETRIES: &str = "fairplace_claim_retries_total";
pub const RECORD_ENTRIES: &str = "fairplace_record_entries_total";
pub const RECORD_DROPPED: &str = "fairplace_record_dropped_total";
pub const RECORD_BYTES: &str = "fairplace_record_bytes_total";
pub const NODE_IDLE_CPUS: &str = "fairplace_node_idle_cpus";
pub const NODE_NR_RUNNING: &str = "fairplace_node_nr_running";
pub const NODE_SCHED_IDLE_CPUS: &str = "fairplace_node_sched_idle_cpus";
pub const NODE_LLC_UTIL: &str = "fairplace_node_llc_util";
pub const NODE_STATE_AGE: &str = "fairplace_node_state_age_seconds";
pub const NODE_DECISIONS: &str = "fairplace_node_decisions_total";
pub const CLUSTER_DECISIONS: &str = "fairplace_cluster_decisions_total";
pub const CLUSTER_GROUPS_COMPARED: &str = "fairplace_cluster_groups_compared";
pub const TASKS_REPORTED: &str = "fairplace_agent_tasks_reported_total";
pub const BALANCE_PASSES: &str = "fairplace_balance_passes_total";
pub const BALANCE_DOMAINS: &str = "fairplace_balance_domains_total";
pub const BALANCE_PROPOSALS: &str = "fairplace_balance_proposals_total";
pub const BALANCE_REJECTIONS: &str = "fairplace_balance_rejections_total";
pub const BALANCE_DURATION: &str = "fairplace_balance_duration_seconds";
pub const CACHE_SCAN_CPUS: &str = "fairplace_cache_scan_cpus";
pub const CACHE_SCAN_PASSES: &str = "fairplace_cache_scan_passes_total";
pub const CACHE_PREF_CHANGES: &str = "fairplace_cache_preference_changes_total";
pub const NODE_CACHE_PROCESSES: &str = "fairplace_node_cache_processes_preferring";
pub const NODE_CACHE_TASKS_PREF: &str = "fairplace_node_cache_tasks_with_preference";
pub const NODE_CACHE_TASKS_ON_PREF: &str = "fairplace_node_cache_tasks_on_preferred_llc";
pub const NODE_SIGNAL_SOURCE: &str = "fairplace_node_signal_source";
pub const CLAIMS_BY_CALLER: &str = "fairplace_claims_total";
pub const TLS_HANDSHAKE_FAILURES: &str = "fairplace_tls_handshake_failures_total";
pub const TLS_RELOADS: &str = "fairplace_tls_reloads_total";
pub const TLS_RELOAD_ERRORS: &str = "fairplace_tls_reload_errors_total";
pub const LEASES_OUTSTANDING: &str = "fairplace_leases_outstanding";
pub const CPUS_LEASED: &str = "fairplace_cpus_leased";
pub const LEASE_GRANTS: &str = "fairplace_lease_grants_total";
pub const LEASE_REFUSALS: &str = "fairplace_lease_refusals_total";
pub const LEASES_ENDED: &str = "fairplace_leases_ended_total";
pub const LEASES_RECOVERED: &str = "fairplace_leases_recovered_total";
pub const LEASE_COMMIT_SECONDS: &str = "fairplace_lease_store_commit_seconds";
pub const LEASE_COMMIT_BATCHES: &str = "fairplace_lease_store_commit_batches";
pub const LEASE_STORE_ERRORS: &str = "fairplace_lease_store_errors_total";
pub const LEASE_UNKNOWN: &str = "fairplace_lease_unknown_outcomes_total";
pub const LEASE_SETTLED: &str = "fairplace_lease_unknown_settled_total";
pub const CONNECTIONS_OPEN: &str = "fairplace_connections_open";
pub const CONNECTIONS_REFUSED: &str = "fairplace_connections_refused_total";
pub const STREAMS_OPEN: &str = "fairplace_streams_open";
pub const REPLICA_MEMBERS: &str = "fairplace_replica_members";
pub const REPLICA_OWNED_NODES: &str = "fairplace_replica_owned_nodes";
pub const REPLICA_LEADER: &str = "fairplace_replica_leader";
pub const REPLICA_ETCD_UP: &str = "fairplace_replica_etcd_up";
pub const REPLICA_HANDOFFS: &str = "fairplace_replica_handoffs_total";
pub const REPLICA_FORWARDS: &str = "fairplace_replica_forwards_total";
pub const REPLICA_REFUSALS: &str = "fairplace_replica_revalidation_refusals_total";
pub const REPLICA_ETCD_SECONDS: &str = "fairplace_replica_etcd_seconds";

/// Every metric with its type and help text, for the README table and the
/// test that /metrics shows them all.
pub const ALL: [(&str, &str, &str); 66] = [
    (
        DECISIONS,
        "counter",
        "Placement decisions, by request kind and the path that chose the CPU.",
    ),
    (
        DECISION_SCANNED,
        "histogram",
        "CPUs whose idle state a placement's scans tested, by kind and path.",
    ),
    (
        DECISION_DURATION,
        "histogram",
        "Time the engine took for one placement decision, in seconds, by kind.",
    ),
    (
        DECISION_STATE_AGE,
        "histogram",
        "Age of the node state a decision read (time since its agent report), in seconds.",
    ),
    (
        MIGRATE_CHECKS,
        "counter",
        "can_migrate_task checks, by verdict and reason.",
    ),
    (
        RPC_REQUESTS,
        "counter",
        "gRPC requests, by method and status code.",
    ),
    (
        RPC_DURATION,
        "histogram",
        "gRPC request handling time, in seconds, by method.",
    ),
    (
        RPC_SHED,
        "counter",
        "gRPC requests refused at once with RESOURCE_EXHAUSTED, by limit: concurrency, heavy, agent_streams, health_watches, reflection_streams.",
    ),
    (
        NODES,
        "gauge",
        "Registered nodes, by freshness (fresh: reported within the staleness TTL).",
    ),
    (
        REPORTS_APPLIED,
        "counter",
        "Agent updates applied to the store, by kind (full or delta).",
    ),
    (
        REPORTS_REJECTED,
        "counter",
        "Agent messages rejected, by reason; the stored state is unchanged.",
    ),
    (
        CPU_UPDATES,
        "counter",
        "Per-CPU states applied from agent updates.",
    ),
    (
        REPORT_APPLY_DURATION,
        "histogram",
        "Time to validate and apply one agent update, in seconds.",
    ),
    (
        CLAIMS_OUTSTANDING,
        "gauge",
        "Claims counted in node states (CPUs chosen with claim=true not yet superseded).",
    ),
    (
        CLAIMS_EXPIRED,
        "counter",
        "Claims that ended by TTL before an agent report superseded them.",
    ),
    (
        CLAIM_RETRIES,
        "counter",
        "Claimed placements decided again because the node changed under them.",
    ),
    (
        RECORD_ENTRIES,
        "counter",
        "Entries written to recordings (--record, AdminService.Record), by kind (state, decision, keyframe).",
    ),
    (
        RECORD_DROPPED,
        "counter",
        "Events a recording lost because its writer fell behind (the decisions on a lost state do not replay).",
    ),
    (
        RECORD_BYTES,
        "counter",
        "Bytes written to recordings, after compression, by sink (file, stream).",
    ),
    (
        NODE_IDLE_CPUS,
        "gauge",
        "Online CPUs of a node whose runqueue is idle (available_idle_cpu), by node.",
    ),
    (
        NODE_NR_RUNNING,
        "gauge",
        "Runnable tasks on a node (sum of nr_running), by node.",
    ),
    (
        NODE_SCHED_IDLE_CPUS,
        "gauge",
        "CPUs of a node running only SCHED_IDLE work, by node.",
    ),
    (
        NODE_LLC_UTIL,
        "gauge",
        "Average util_avg (0..1024) of an LLC's online CPUs, by node and LLC.",
    ),
    (
        NODE_STATE_AGE,
        "gauge",
        "Seconds since a node's last applied agent report, by node.",
    ),
    (
        NODE_DECISIONS,
        "counter",
        "Placement decisions made on a node, by node and request kind.",
    ),
    (
        CLUSTER_DECISIONS,
        "counter",
        "Placements with no node, by the highest cluster level where the choice left the local group.",
    ),
    (
        CLUSTER_GROUPS_COMPARED,
        "histogram",
        "Groups and nodes compared by one cluster placement.",
    ),
    (
        TASKS_REPORTED,
        "counter",
        "Runnable tasks received in agent task lists.",
    ),
    (
        BALANCE_PASSES,
        "counter",
        "Load-balance passes, by scope (node or a cluster level).",
    ),
    (
        BALANCE_DOMAINS,
        "counter",
        "Domains a balance pass looked at, by outcome (balanced: sched_balance_rq ran; declined: should_we_balance said another CPU balances; not_due: interval not expired).",
    ),
    (
        BALANCE_PROPOSALS,
        "counter",
        "Migration proposals, by migration type and kind (detach or active).",
    ),
    (
        BALANCE_REJECTIONS,
        "counter",
        "Tasks can_migrate_task refused during balance passes, by reason.",
    ),
    (
        BALANCE_DURATION,
        "histogram",
        "Time one balance pass took, in seconds, by scope.",
    ),
    (
        CACHE_SCAN_CPUS,
        "histogram",
        "CPUs whose per-process record one task_cache_work pass read, by strategy (full or visit).",
    ),
    (
        CACHE_SCAN_PASSES,
        "counter",
        "task_cache_work passes, by strategy.",
    ),
    (
        CACHE_PREF_CHANGES,
        "counter",
        "Preferred-LLC changes made by task_cache_work.",
    ),
    (
        NODE_CACHE_PROCESSES,
        "gauge",
        "Processes with a preferred LLC, by node.",
    ),
    (
        NODE_CACHE_TASKS_PREF,
        "gauge",
        "Reported runnable tasks whose process has a preferred LLC, by node.",
    ),
    (
        NODE_CACHE_TASKS_ON_PREF,
        "gauge",
        "Reported runnable tasks queued on their process's preferred LLC, by node.",
    ),
    (
        NODE_SIGNAL_SOURCE,
        "gauge",
        "1 for the source a node's agent reads its signals from (procfs, sched_debug, bpf, simulated, unspecified), by node.",
    ),
    (
        CLAIMS_BY_CALLER,
        "counter",
        "CPUs claimed (claimed PickCpu, Balance with apply), by caller: the client certificate's name, or anonymous without client authentication.",
    ),
    (
        TLS_HANDSHAKE_FAILURES,
        "counter",
        "TLS handshakes on the gRPC port that failed (no or untrusted client certificate, plaintext, bad protocol).",
    ),
    (
        TLS_RELOADS,
        "counter",
        "Times a changed TLS certificate, key or client CA was reloaded.",
    ),
    (
        TLS_RELOAD_ERRORS,
        "counter",
        "Changed TLS files that could not be used (the current ones were kept).",
    ),
    (
        LEASES_OUTSTANDING,
        "gauge",
        "CPU leases (AllocateCpus) outstanding across all nodes.",
    ),
    (
        CPUS_LEASED,
        "gauge",
        "CPUs held by leases across all nodes.",
    ),
    (LEASE_GRANTS, "counter", "Leases granted, by policy."),
    (
        LEASE_REFUSALS,
        "counter",
        "AllocateCpus requests refused, by policy and reason (invalid, node, leased, cores, llc, apply, busy, store, caller_limit).",
    ),
    (
        LEASES_ENDED,
        "counter",
        "Leases ended, by how: released, expired, target_gone, apply_failed, abandoned (its AllocateCpus was cut short before it answered), topology (CPUs the node no longer has). Counted once the end is committed, or for ended-with-unknown-outcome ends once begun.",
    ),
    (
        LEASE_UNKNOWN,
        "counter",
        "Lease commits whose outcome was unknown (a timeout, a lost answer, a failed fsync), by change: grant, renew, end. The lease keeps its CPUs until the outcome is settled.",
    ),
    (
        LEASE_SETTLED,
        "counter",
        "Unknown lease commit outcomes settled, by change and outcome: applied (the change took effect), not_applied.",
    ),
    (
        LEASES_RECOVERED,
        "counter",
        "Leases found after a restart, by how: loaded (from the lease store at start), expired (at start or reported by an agent), kept (an agent's lease the server knew), adopted (an agent's lease the server had lost), conflict (an agent's lease refused, or a later one of the server's ended).",
    ),
    (
        LEASE_COMMIT_SECONDS,
        "histogram",
        "Time of one lease-store commit (one transaction and its fsync, for every grant, renewal and release waiting).",
    ),
    (
        LEASE_COMMIT_BATCHES,
        "histogram",
        "Lease ops batches committed together in one lease-store transaction (group commit).",
    ),
    (
        LEASE_STORE_ERRORS,
        "counter",
        "Lease-store commits that failed (their RPCs answered UNAVAILABLE).",
    ),
    (
        CONNECTIONS_OPEN,
        "gauge",
        "TCP connections open on the gRPC and health ports, from accept (screening included) to close.",
    ),
    (
        CONNECTIONS_REFUSED,
        "counter",
        "Connections closed at accept, by the cap they hit: total (--max-connections), per_peer (--max-connections-per-peer), screening (too many still sending their preface or TLS handshake).",
    ),
    (
        STREAMS_OPEN,
        "gauge",
        "Long-lived streams open, by kind: agent (AgentService.Report), health_watch (grpc.health.v1 Watch), reflection.",
    ),
    (
        REPLICA_MEMBERS,
        "gauge",
        "Live replicas this replica sees in etcd (with --etcd-endpoints).",
    ),
    (
        REPLICA_OWNED_NODES,
        "gauge",
        "Nodes whose ownership this replica holds in etcd.",
    ),
    (
        REPLICA_LEADER,
        "gauge",
        "1 while this replica is the elected balancer, else 0.",
    ),
    (
        REPLICA_ETCD_UP,
        "gauge",
        "1 while this replica's etcd lease is known alive (it may grant), 0 while it has lost etcd (grants, renewals and releases refused).",
    ),
    (
        REPLICA_HANDOFFS,
        "counter",
        "Node ownership changes at this replica, by how: claimed, released (handed to another replica), redirected (an agent sent to the owner), client_redirected (a routing client sent to the owner), lost (the etcd lease ended or another replica holds the node).",
    ),
    (
        REPLICA_FORWARDS,
        "counter",
        "Calls passed to another replica, by method and outcome (ok, or the gRPC code).",
    ),
    (
        REPLICA_REFUSALS,
        "counter",
        "Cluster placements chosen from another replica's published aggregates that the node's owner refused on its live state (another node is then chosen, twice at most), by method.",
    ),
    (
        REPLICA_ETCD_SECONDS,
        "histogram",
        "Time of one etcd round trip, by op: claim, release, commit, keepalive, read, campaign.",
    ),
];

/// The metrics only a replica (`--etcd-endpoints`) exports.
pub const REPLICA_ONLY: [&str; 8] = [
    REPLICA_REFUSALS,
    REPLICA_MEMBERS,
    REPLICA_OWNED_NODES,
    REPLICA_LEADER,
    REPLICA_ETCD_UP,
    REPLICA_HANDOFFS,
    REPLICA_FORWARDS,
    REPLICA_ETCD_SECONDS,
];

/// The metrics rendered here rather than by the recorder (the recorder
/// never holds them, so each family appears once).
pub const STORE_RENDERED: [&str; 14] = [
    NODES,
    CLAIMS_OUTSTANDING,
    LEASES_OUTSTANDING,
    CPUS_LEASED,
    NODE_IDLE_CPUS,
    NODE_NR_RUNNING,
    NODE_SCHED_IDLE_CPUS,
    NODE_LLC_UTIL,
    NODE_STATE_AGE,
    NODE_DECISIONS,
    NODE_CACHE_PROCESSES,
    NODE_CACHE_TASKS_PREF,
    NODE_CACHE_TASKS_ON_PREF,
    NODE_SIGNAL_SOURCE,
];

pub use decisions::{record as record_decision, render as render_decisions};

/// The families rendered from the decision tables ([`decisions`]) rather
/// than by the recorder.
pub const DECISION_RENDERED: [&str; 4] = [
    DECISIONS,
    DECISION_SCANNED,
    DECISION_DURATION,
    DECISION_STATE_AGE,
];

/// Writes one family rendered outside the recorder: its HELP and TYPE
/// lines (from [`ALL`]), then `samples`.
pub fn write_family(out: &mut String, name: &str, samples: &str) {
    let (kind, help) = ALL
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, k, h)| (*k, *h))
        .expect("every metric rendered outside the recorder is in metrics::ALL");
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    out.push_str(samples);
    out.push('\n');
}

/// Records one task_cache_work pass.
pub fn record_cache_scan(r: &crate::engine::cache::ScanReport) {
    let s = r.strategy.as_str();
    metrics::histogram!(CACHE_SCAN_CPUS, "strategy" => s).record(r.scanned as f64);
    metrics::counter!(CACHE_SCAN_PASSES, "strategy" => s).increment(1);
    if r.changed {
        metrics::counter!(CACHE_PREF_CHANGES).increment(1);
    }
}

/// Records one balance pass.
pub fn record_balance(
    scope: &'static str,
    stats: &crate::engine::balance::PassStats,
    proposals: impl Iterator<Item = (&'static str, bool)>,
    took: f64,
) {
    metrics::counter!(BALANCE_PASSES, "scope" => scope).increment(1);
    metrics::histogram!(BALANCE_DURATION, "scope" => scope).record(took);
    for (outcome, n) in [
        ("balanced", stats.domains_balanced),
        ("declined", stats.domains_declined),
        ("not_due", stats.domains_not_due),
    ] {
        if n > 0 {
            metrics::counter!(BALANCE_DOMAINS, "outcome" => outcome).increment(n as u64);
        }
    }
    for (ty, active) in proposals {
        let kind = if active { "active" } else { "detach" };
        metrics::counter!(BALANCE_PROPOSALS, "type" => ty, "kind" => kind).increment(1);
    }
    for (reason, n) in stats.rejection_counts() {
        metrics::counter!(BALANCE_REJECTIONS, "reason" => reason).increment(n);
    }
}

const LATENCY_BUCKETS: [f64; 16] = [
    1e-7, 2.5e-7, 5e-7, 1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3,
    2.5e-2, 1e-1,
];
/// A commit is an fsync: tens of microseconds on a fast SSD, tens of
/// milliseconds on a busy disk.
const COMMIT_BUCKETS: [f64; 12] = [
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 1e-1, 1.0,
];
const SCANNED_BUCKETS: [f64; 13] = [
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];
const AGE_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Why the metrics recorder cannot be installed: a histogram's buckets are
/// refused (a bug in the tables above), or a recorder is installed already
/// (the process installed one before; only one can exist). Either way
/// nothing is recorded, so the server stops rather than serve blind.
#[derive(Debug)]
pub enum RecorderError {
    /// The exporter refused a metric's histogram buckets.
    Buckets(metrics_exporter_prometheus::BuildError),
    /// Another global recorder was installed first.
    AlreadyInstalled(metrics::SetRecorderError<()>),
}

impl std::fmt::Display for RecorderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecorderError::Buckets(e) => write!(f, "{e}"),
            RecorderError::AlreadyInstalled(e) => write!(f, "metrics recorder: {e}"),
        }
    }
}

impl std::error::Error for RecorderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RecorderError::Buckets(e) => Some(e),
            RecorderError::AlreadyInstalled(e) => Some(e),
        }
    }
}

/// Installs the global recorder (buckets, help text, the series that
/// exist from the start) and returns its handle, which renders it.
pub fn install_recorder() -> Result<PrometheusHandle, RecorderError> {
    let recorder = builder()?.build_recorder();
    let handle = recorder.handle();
    // The refused recorder is dropped: the error keeps only the message.
    metrics::set_global_recorder(recorder)
        .map_err(|_| RecorderError::AlreadyInstalled(metrics::SetRecorderError(())))?;
    describe();
    // Unlabelled series exist from the start, so a scrape (and an alert on
    // their rate) sees them before the first event.
    for name in [
        RPC_SHED,
        CPU_UPDATES,
        CLAIMS_EXPIRED,
        CLAIM_RETRIES,
        RECORD_DROPPED,
        TASKS_REPORTED,
        CACHE_PREF_CHANGES,
        TLS_HANDSHAKE_FAILURES,
        TLS_RELOADS,
        TLS_RELOAD_ERRORS,
        LEASE_STORE_ERRORS,
    ] {
        metrics::counter!(name).absolute(0);
    }
    metrics::gauge!(CONNECTIONS_OPEN).set(0.0);
    metrics::counter!(CONNECTIONS_REFUSED, "limit" => "per_peer").absolute(0);
    for kind in ["agent", "health_watch", "reflection"] {
        metrics::gauge!(STREAMS_OPEN, "kind" => kind).set(0.0);
    }
    metrics::counter!(CLAIMS_BY_CALLER, "caller" => "anonymous").absolute(0);
    for p in crate::engine::alloc::Policy::ALL {
        metrics::counter!(LEASE_GRANTS, "policy" => p.as_str()).absolute(0);
    }
    metrics::counter!(LEASE_REFUSALS, "policy" => "kernel", "reason" => "leased").absolute(0);
    metrics::counter!(LEASES_ENDED, "how" => "released").absolute(0);
    metrics::counter!(LEASE_UNKNOWN, "change" => "grant").absolute(0);
    metrics::counter!(LEASE_SETTLED, "change" => "grant", "outcome" => "applied").absolute(0);
    metrics::counter!(LEASES_RECOVERED, "how" => "loaded").absolute(0);
    Ok(handle)
}

fn builder() -> Result<PrometheusBuilder, RecorderError> {
    // The recorder holds only series whose label values come from fixed
    // sets; the per-node series are rendered from the store at each scrape
    // (`exposition`), so nothing here needs to expire.
    let b = PrometheusBuilder::new();
    let set = |b: PrometheusBuilder, m: &str, buckets: &[f64]| {
        b.set_buckets_for_metric(Matcher::Full(m.to_string()), buckets)
            .map_err(RecorderError::Buckets)
    };
    let b = set(b, RPC_DURATION, &LATENCY_BUCKETS)?;
    let b = set(b, REPORT_APPLY_DURATION, &LATENCY_BUCKETS)?;
    let b = set(b, CLUSTER_GROUPS_COMPARED, &SCANNED_BUCKETS)?;
    let b = set(b, CACHE_SCAN_CPUS, &SCANNED_BUCKETS)?;
    let b = set(b, BALANCE_DURATION, &LATENCY_BUCKETS)?;
    let b = set(b, LEASE_COMMIT_SECONDS, &COMMIT_BUCKETS)?;
    let b = set(b, LEASE_COMMIT_BATCHES, &SCANNED_BUCKETS)?;
    set(b, REPLICA_ETCD_SECONDS, &COMMIT_BUCKETS)
}

/// Help text; must run after the recorder is installed, or it is dropped.
/// (The store-rendered and decision metrics write their own.)
fn describe() {
    for (name, kind, help) in ALL {
        if STORE_RENDERED.contains(&name) || DECISION_RENDERED.contains(&name) {
            continue;
        }
        let unit = if name.ends_with("_seconds") {
            Some(Unit::Seconds)
        } else {
            None
        };
        match (kind, unit) {
            ("counter", _) => describe_counter!(name, help),
            ("gauge", _) => describe_gauge!(name, help),
            (_, Some(u)) => describe_histogram!(name, u, help),
            _ => describe_histogram!(name, help),
        }
    }
}
