//! Balance passes: proposals and pass statistics as the answer, with the
//! prose that says why each proposal was made.

use fairplace_proto::v1 as pb;

use crate::engine::balance::cluster::ClusterBalanceOutcome;
use crate::engine::balance::migrate::MigrationType;
use crate::engine::balance::{PassStats, Proposal};
use crate::engine::cpumask::CpuMask;
use crate::engine::group::GroupType;
use crate::engine::topology::{FieldError, Topology};
use crate::store::passes::BalanceOutcome;

use super::fields::{cpulist, err};

pub fn migration_type_to_pb(m: MigrationType) -> pb::MigrationType {
    match m {
        MigrationType::Load => pb::MigrationType::Load,
        MigrationType::Util => pb::MigrationType::Util,
        MigrationType::Task => pb::MigrationType::Task,
        MigrationType::Misfit => pb::MigrationType::Misfit,
        MigrationType::LlcTask => pb::MigrationType::LlcTask,
    }
}

/// A proposal of the node balancer.
pub fn proposal_to_pb(p: &Proposal, node: &str) -> pb::Proposal {
    let kind = if p.active { "active" } else { "detach" };
    let reason = proposal_reason(
        &p.level.to_string(),
        kind,
        p.busiest,
        p.local,
        p.imbalance,
        p.migration_type,
        p.forced_hot.then_some(p.nr_balance_failed),
        p.llc_preference,
    );
    pb::Proposal {
        task: p.task,
        group: p.group,
        src_node: node.to_string(),
        src_cpu: p.src_cpu as u32,
        dst_node: node.to_string(),
        dst_cpu: p.dst_cpu as u32,
        migration_type: migration_type_to_pb(p.migration_type) as i32,
        kind: kind.to_string(),
        level: p.level.to_string(),
        busiest_group: p.busiest.as_str().to_string(),
        local_group: p.local.as_str().to_string(),
        imbalance: p.imbalance,
        forced_hot: p.forced_hot,
        nr_balance_failed: p.nr_balance_failed,
        llc_preference: p.llc_preference,
        reason,
    }
}

pub fn balance_response(o: &BalanceOutcome, node: &str) -> pb::BalanceResponse {
    pb::BalanceResponse {
        proposals: o
            .proposals
            .iter()
            .map(|p| proposal_to_pb(p, node))
            .collect(),
        domains_balanced: o.stats.domains_balanced,
        domains_declined: o.stats.domains_declined,
        rejections: rejections_pb(&o.stats),
        state_version: o.version,
        claimed: o.claimed,
    }
}

/// The destination CPUs of a balance request.
pub fn balance_cpus(s: &str, topo: &Topology) -> Result<Option<CpuMask>, FieldError> {
    let m = cpulist(s, topo, "cpus")?;
    if let Some(m) = &m
        && !m.intersects(&topo.online)
    {
        return Err(err("cpus", "names no online CPU"));
    }
    Ok(m)
}

pub fn cluster_balance_response(o: &ClusterBalanceOutcome) -> pb::BalanceResponse {
    pb::BalanceResponse {
        proposals: o
            .proposals
            .iter()
            .map(|p| {
                let reason = proposal_reason(
                    &p.level,
                    "detach",
                    p.busiest,
                    p.local,
                    p.imbalance,
                    p.migration_type,
                    p.forced_hot.then_some(p.nr_balance_failed),
                    false,
                );
                pb::Proposal {
                    task: p.task,
                    group: p.group,
                    src_node: p.src_node.clone(),
                    src_cpu: p.src_cpu as u32,
                    dst_node: p.dst_node.clone(),
                    dst_cpu: p.dst_cpu as u32,
                    migration_type: migration_type_to_pb(p.migration_type) as i32,
                    kind: "detach".into(),
                    level: p.level.clone(),
                    busiest_group: p.busiest.as_str().to_string(),
                    local_group: p.local.as_str().to_string(),
                    imbalance: p.imbalance,
                    forced_hot: p.forced_hot,
                    nr_balance_failed: p.nr_balance_failed,
                    llc_preference: false,
                    reason,
                }
            })
            .collect(),
        domains_balanced: o.stats.domains_balanced,
        domains_declined: o.stats.domains_declined,
        rejections: rejections_pb(&o.stats),
        state_version: 0,
        claimed: o.claimed,
    }
}

pub(super) fn rejections_pb(stats: &PassStats) -> Vec<pb::RejectionCount> {
    stats
        .rejection_counts()
        .map(|(r, c)| pb::RejectionCount {
            reason: r.to_string(),
            count: c,
        })
        .collect()
}

/// The human-readable why of a proposal.
#[allow(clippy::too_many_arguments)]
pub(super) fn proposal_reason(
    level: &str,
    kind: &str,
    busiest: GroupType,
    local: GroupType,
    imbalance: i64,
    ty: MigrationType,
    forced_hot: Option<u32>,
    llc: bool,
) -> String {
    let mut r = format!(
        "{level} {kind}: busiest group {} vs local {}, imbalance {imbalance} ({})",
        busiest.as_str(),
        local.as_str(),
        ty.as_str()
    );
    if let Some(n) = forced_hot {
        r.push_str(&format!("; cache-hot, moved after {n} failed balances"));
    }
    if llc {
        r.push_str("; toward the process's preferred LLC");
    }
    r
}
