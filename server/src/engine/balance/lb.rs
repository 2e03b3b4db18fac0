//! The load balancer's group arithmetic:
//! `update_sd_pick_busiest`, the balanced-or-not decision at the end of
//! `sched_balance_find_src_group` and `calculate_imbalance`.
//!
//! These read only per-group sums, so the node balancer (groups of CPUs) and
//! the cluster balancer (groups of nodes) share them.

use crate::engine::balance::migrate::MigrationType;
use crate::engine::group::{GroupType, SgLbStats, adjust_numa_imbalance};

/// The domain and destination facts the decisions read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DomainParams {
    pub imbalance_pct: u32,
    pub numa: bool,
    pub share_llc: bool,
    pub asym_cpucapacity: bool,
    pub imb_numa_nr: u32,
    /// `env->idle != CPU_NOT_IDLE`.
    pub dst_idle: bool,
    /// `env->dst_core_idle`.
    pub dst_core_idle: bool,
    /// `capacity_of(env->dst_cpu)`.
    pub dst_capacity: u64,
}

/// `capacity_greater()`: more than ~5 % larger.
#[inline]
pub fn capacity_greater(a: u64, b: u64) -> bool {
    a * 1024 > b * 1078
}

/// `smt_vs_nonsmt_groups()`: false while there is no busiest group yet
/// (the sentinel has no CPUs).
#[inline]
fn smt_vs_nonsmt_groups(a: &SgLbStats, b: &SgLbStats) -> bool {
    a.group_weight != 0 && b.group_weight != 0 && a.smt != b.smt
}

/// `update_sd_pick_busiest()`: is `sg` busier than the busiest so far?
/// `local_type` is the local group's type (the misfit rule reads it).
pub fn update_sd_pick_busiest(
    p: &DomainParams,
    local_type: GroupType,
    busiest: &SgLbStats,
    sg: &SgLbStats,
) -> bool {
    if sg.sum_h_nr_running == 0 {
        return false;
    }
    // A misfit task only moves to a CPU that is bigger and whose group has room.
    if p.asym_cpucapacity
        && sg.group_type == GroupType::MisfitTask
        && (!p.dst_core_idle
            || !capacity_greater(p.dst_capacity, sg.max_capacity)
            || local_type != GroupType::HasSpare)
    {
        return false;
    }
    // A faster group is not relieved by a slower destination.
    if p.asym_cpucapacity
        && sg.group_type <= GroupType::FullyBusy
        && capacity_greater(sg.min_capacity, p.dst_capacity)
    {
        return false;
    }
    if sg.group_type > busiest.group_type {
        return true;
    }
    if sg.group_type < busiest.group_type {
        return false;
    }
    match sg.group_type {
        GroupType::Overloaded => return sg.avg_load > busiest.avg_load,
        GroupType::LlcBalance => return sg.nr_pref_dst_llc > busiest.nr_pref_dst_llc,
        // The first imbalanced group found is kept.
        GroupType::Imbalanced => return false,
        // Asym packing is not modelled: no group is ever of this type.
        GroupType::AsymPacking => return false,
        GroupType::MisfitTask => return sg.group_misfit_task_load > busiest.group_misfit_task_load,
        GroupType::SmtBalance => {
            if sg.idle_cpus != 0 || busiest.idle_cpus != 0 {
                if !has_spare_busier(busiest, sg) {
                    return false;
                }
            } else if !fully_busy_busier(busiest, sg) {
                return false;
            }
        }
        GroupType::FullyBusy => {
            if !fully_busy_busier(busiest, sg) {
                return false;
            }
        }
        GroupType::HasSpare => {
            // An SMT core running two tasks needs help more than a group
            // of single CPUs, and one running a single task less.
            if smt_vs_nonsmt_groups(busiest, sg) {
                return !(sg.smt && sg.sum_h_nr_running <= 1);
            }
            if !has_spare_busier(busiest, sg) {
                return false;
            }
        }
    }
    true
}

/// The fully-busy rule: the higher average load wins; on a tie an SMT
/// busiest is kept (avg_load is not computed for such groups, so ties are
/// the rule).
fn fully_busy_busier(busiest: &SgLbStats, sg: &SgLbStats) -> bool {
    if sg.avg_load < busiest.avg_load {
        return false;
    }
    !(sg.avg_load == busiest.avg_load && busiest.smt)
}

/// The has-spare rule: fewer idle CPUs, then more tasks.
fn has_spare_busier(busiest: &SgLbStats, sg: &SgLbStats) -> bool {
    if sg.idle_cpus > busiest.idle_cpus {
        return false;
    }
    !(sg.idle_cpus == busiest.idle_cpus && sg.sum_nr_running <= busiest.sum_nr_running)
}

/// `struct sd_lb_stats` totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SdTotals {
    pub total_load: u64,
    pub total_capacity: u64,
    /// `sds->avg_load`, once computed.
    pub avg_load: u64,
    pub prefer_sibling: bool,
}

/// `sibling_imbalance()`: tasks to move so both groups run the same number
/// of tasks per core.
pub fn sibling_imbalance(p: &DomainParams, busiest: &SgLbStats, local: &SgLbStats) -> i64 {
    if !p.dst_idle || busiest.sum_nr_running == 0 {
        return 0;
    }
    let (nb, nl) = (busiest.cores as i64, local.cores as i64);
    let (rb, rl) = (busiest.sum_nr_running as i64, local.sum_nr_running as i64);
    if nb == nl {
        return (rb - rl).max(0);
    }
    let mut imb = (nl * rb - nb * rl).max(0);
    imb = (2 * imb + nl + nb) / (nl + nb);
    // An empty group takes two so the busiest does not stay ahead.
    if imb <= 1 && rl == 0 && rb > 1 {
        imb = 2;
    }
    imb
}

/// What the source-group search concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imbalance {
    pub migration_type: MigrationType,
    pub imbalance: i64,
}

/// The end of `sched_balance_find_src_group()`: balanced before any
/// computation (`None`), or what `calculate_imbalance()` asks for, which is
/// balanced too when its amount is 0 (the type still counts for the exits
/// of `sched_balance_rq`). `local` may get its avg_load computed, as the
/// kernel's does.
pub fn find_busiest_decision(
    p: &DomainParams,
    sds: &mut SdTotals,
    local: &mut SgLbStats,
    busiest: &SgLbStats,
) -> Option<Imbalance> {
    let force = matches!(
        busiest.group_type,
        GroupType::MisfitTask | GroupType::AsymPacking | GroupType::Imbalanced
    );
    if !force {
        if local.group_type > busiest.group_type {
            return None;
        }
        if local.group_type == GroupType::Overloaded {
            if local.avg_load >= busiest.avg_load {
                return None;
            }
            sds.avg_load = sds.total_load * 1024 / sds.total_capacity.max(1);
            if local.avg_load >= sds.avg_load {
                return None;
            }
            if 100 * busiest.avg_load <= p.imbalance_pct as u64 * local.avg_load {
                return None;
            }
        }
        let sibling = sds.prefer_sibling
            && local.group_type == GroupType::HasSpare
            && (busiest.group_type == GroupType::LlcBalance
                || sibling_imbalance(p, busiest, local) > 1);
        if !sibling && busiest.group_type != GroupType::Overloaded {
            // Only an idle CPU pulls from a group that is not overloaded.
            if !p.dst_idle {
                return None;
            }
            let smt_pull =
                busiest.group_type == GroupType::SmtBalance && smt_vs_nonsmt_groups(local, busiest);
            if !smt_pull {
                if busiest.group_weight > 1 && local.idle_cpus <= busiest.idle_cpus + 1 {
                    return None;
                }
                if busiest.sum_h_nr_running == 1 {
                    return None;
                }
            }
        }
    }
    Some(calculate_imbalance(p, sds, local, busiest))
}

/// `calculate_imbalance()`: how much to move, in the units of the chosen
/// migration type.
pub fn calculate_imbalance(
    p: &DomainParams,
    sds: &mut SdTotals,
    local: &mut SgLbStats,
    busiest: &SgLbStats,
) -> Imbalance {
    let mk = |migration_type, imbalance| Imbalance {
        migration_type,
        imbalance,
    };
    match busiest.group_type {
        GroupType::MisfitTask => {
            return if p.asym_cpucapacity {
                mk(MigrationType::Misfit, 1)
            } else {
                // A CPU of reduced capacity: move its load.
                mk(MigrationType::Load, busiest.group_misfit_task_load as i64)
            };
        }
        GroupType::AsymPacking => {
            return mk(MigrationType::Task, busiest.sum_h_nr_running as i64);
        }
        GroupType::SmtBalance | GroupType::Imbalanced => return mk(MigrationType::Task, 1),
        GroupType::LlcBalance => return mk(MigrationType::LlcTask, 1),
        _ => {}
    }
    if local.group_type == GroupType::HasSpare {
        if busiest.group_type > GroupType::FullyBusy && !p.share_llc {
            // Fill the local group's spare capacity, not more.
            let imb = local.group_capacity.max(local.group_util) - local.group_util;
            if p.dst_idle && imb == 0 {
                return mk(MigrationType::Task, 1);
            }
            return mk(MigrationType::Util, imb as i64);
        }
        let mut imb = if busiest.group_weight == 1 || sds.prefer_sibling {
            sibling_imbalance(p, busiest, local)
        } else {
            // An unsigned int difference: fewer local idle CPUs wrap to a
            // huge count, as in the kernel.
            local.idle_cpus.wrapping_sub(busiest.idle_cpus) as i64
        };
        if p.numa {
            imb = adjust_numa_imbalance(imb, local.sum_nr_running as i64 + 1, p.imb_numa_nr as i64);
        }
        return mk(MigrationType::Task, imb >> 1);
    }
    if local.group_type < GroupType::Overloaded {
        // Local will become overloaded: only now are averages needed.
        local.avg_load = local.group_load * 1024 / local.group_capacity.max(1);
        if local.avg_load >= busiest.avg_load {
            return mk(MigrationType::Load, 0);
        }
        sds.avg_load = sds.total_load * 1024 / sds.total_capacity.max(1);
        if local.avg_load >= sds.avg_load {
            return mk(MigrationType::Load, 0);
        }
    }
    // Unsigned arithmetic, as the kernel's: a negative difference wraps and
    // loses the min().
    let a = busiest
        .avg_load
        .wrapping_sub(sds.avg_load)
        .wrapping_mul(busiest.group_capacity);
    let b = sds
        .avg_load
        .wrapping_sub(local.avg_load)
        .wrapping_mul(local.group_capacity);
    mk(MigrationType::Load, (a.min(b) / 1024) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::group::{finish_lb_stats, group_classify};

    fn params(idle: bool) -> DomainParams {
        DomainParams {
            imbalance_pct: 117,
            numa: false,
            share_llc: true,
            asym_cpucapacity: false,
            imb_numa_nr: 0,
            dst_idle: idle,
            dst_core_idle: idle,
            dst_capacity: 1024,
        }
    }

    fn group(weight: u32, nr: u32, util: u64, runnable: u64, load: u64) -> SgLbStats {
        let mut s = SgLbStats {
            group_weight: weight,
            group_capacity: 1024 * weight as u64,
            sum_nr_running: nr,
            sum_h_nr_running: nr,
            group_util: util,
            group_runnable: runnable,
            group_load: load,
            cores: weight,
            min_capacity: 1024,
            max_capacity: 1024,
            ..SgLbStats::default()
        };
        finish_lb_stats(117, &mut s);
        s
    }

    #[test]
    fn classify_follows_the_test_order() {
        // 3 tasks on 2 CPUs with util 2048 * 117 > 2048 * 100: overloaded,
        // avg_load = 3072 * 1024 / 2048.
        let g = group(2, 3, 2048, 3072, 3072);
        assert_eq!(g.group_type, GroupType::Overloaded);
        assert_eq!(g.avg_load, 1536);
        // 2 tasks on 2 CPUs, busy: fully busy (capacity 2048*100 <= 2048*117).
        assert_eq!(
            group(2, 2, 2048, 2048, 2048).group_type,
            GroupType::FullyBusy
        );
        // 1 task on 2 CPUs: spare.
        assert_eq!(
            group(2, 1, 1024, 1024, 1024).group_type,
            GroupType::HasSpare
        );
        // The affinity flag ranks above misfit but below overloaded.
        let mut s = group(2, 1, 100, 100, 100);
        s.sgc_imbalance = true;
        s.group_misfit_task_load = 5;
        assert_eq!(group_classify(117, &s), GroupType::Imbalanced);
        s.sgc_imbalance = false;
        assert_eq!(group_classify(117, &s), GroupType::MisfitTask);
    }

    #[test]
    fn pick_busiest_prefers_fewer_idle_then_more_tasks() {
        let p = params(true);
        let a = group(4, 2, 2048, 2048, 2048); // 2 idle (say)
        let mut a2 = a;
        a2.idle_cpus = 2;
        let mut b = group(4, 3, 3072, 3072, 3072);
        b.idle_cpus = 1;
        assert!(update_sd_pick_busiest(
            &p,
            GroupType::HasSpare,
            &SgLbStats::NO_BUSIEST,
            &a2
        ));
        assert!(update_sd_pick_busiest(&p, GroupType::HasSpare, &a2, &b));
        assert!(!update_sd_pick_busiest(&p, GroupType::HasSpare, &b, &a2));
        // Same idle count and no more tasks: keep the first.
        let mut c = b;
        c.sum_nr_running = 3;
        assert!(!update_sd_pick_busiest(&p, GroupType::HasSpare, &b, &c));
        // An empty group is never the busiest.
        let e = group(4, 0, 0, 0, 0);
        assert!(!update_sd_pick_busiest(
            &p,
            GroupType::HasSpare,
            &SgLbStats::NO_BUSIEST,
            &e
        ));
    }

    #[test]
    fn sibling_imbalance_by_hand() {
        let p = params(true);
        // Equal cores: the difference of task counts.
        let l = group(4, 1, 0, 0, 0);
        let b = group(4, 4, 0, 0, 0);
        assert_eq!(sibling_imbalance(&p, &b, &l), 3);
        // 2 cores vs 4 cores, 4 tasks vs 0: x = 4*4 - 2*0 = 16,
        // (32 + 4 + 2) / 6 = 6.
        let mut l2 = group(4, 0, 0, 0, 0);
        l2.cores = 4;
        let mut b2 = group(2, 4, 0, 0, 0);
        b2.cores = 2;
        assert_eq!(sibling_imbalance(&p, &b2, &l2), 6);
        // Busy destination: nothing.
        assert_eq!(sibling_imbalance(&params(false), &b, &l), 0);
    }

    #[test]
    fn overloaded_busiest_against_spare_local_moves_tasks() {
        // LLC domain, local 4 CPUs with 1 task (3 idle), busiest 4 CPUs with
        // 6 tasks (overloaded, 0 idle). Local has spare, busiest > fully busy
        // but SD_SHARE_LLC: task type; prefer_sibling: sibling_imbalance =
        // 6 - 1 = 5, halved = 2.
        let p = params(true);
        let mut local = group(4, 1, 1024, 1024, 1024);
        local.idle_cpus = 3;
        let busiest = group(4, 6, 4096 * 117 / 100 + 100, 6144, 6144);
        assert_eq!(busiest.group_type, GroupType::Overloaded);
        let mut sds = SdTotals {
            total_load: 7168,
            total_capacity: 8192,
            avg_load: 0,
            prefer_sibling: true,
        };
        let imb = find_busiest_decision(&p, &mut sds, &mut local, &busiest).unwrap();
        assert_eq!(imb.migration_type, MigrationType::Task);
        assert_eq!(imb.imbalance, 2);
        // Above the LLC the same groups ask for util: 4096 - 1024.
        let p2 = DomainParams {
            share_llc: false,
            ..p
        };
        let imb = calculate_imbalance(&p2, &mut sds, &mut local, &busiest);
        assert_eq!(imb.migration_type, MigrationType::Util);
        assert_eq!(imb.imbalance, 3072);
    }

    #[test]
    fn both_overloaded_move_load_down_to_the_average() {
        let p = params(false);
        // local: 2 CPUs, 3 tasks, load 3072 → avg 1536; busiest: 2 CPUs,
        // 6 tasks, load 6144 → avg 3072. Totals 9216 / 4096 → avg 2304.
        let mut local = group(2, 3, 2400, 3072, 3072);
        let busiest = group(2, 6, 2400, 6144, 6144);
        assert_eq!(local.group_type, GroupType::Overloaded);
        let mut sds = SdTotals {
            total_load: 9216,
            total_capacity: 4096,
            avg_load: 0,
            prefer_sibling: false,
        };
        let imb = find_busiest_decision(&p, &mut sds, &mut local, &busiest).unwrap();
        assert_eq!(sds.avg_load, 2304);
        // min((3072-2304)*2048, (2304-1536)*2048) / 1024 = 1536.
        assert_eq!(
            imb,
            Imbalance {
                migration_type: MigrationType::Load,
                imbalance: 1536
            }
        );
        // Within 17 % of each other: balanced.
        let mut local2 = group(2, 3, 2400, 3072, 3072);
        let near = group(2, 4, 2400, 3500, 3500);
        let mut sds2 = SdTotals {
            total_load: 6572,
            total_capacity: 4096,
            ..SdTotals::default()
        };
        assert_eq!(
            find_busiest_decision(&p, &mut sds2, &mut local2, &near),
            None
        );
    }

    #[test]
    fn busy_destination_does_not_pull_from_a_group_with_spare() {
        let p = params(false);
        let mut local = group(4, 4, 1000, 1000, 1000);
        local.idle_cpus = 0;
        let mut busiest = group(4, 3, 500, 500, 500);
        busiest.idle_cpus = 1;
        let mut sds = SdTotals::default();
        assert_eq!(
            find_busiest_decision(&p, &mut sds, &mut local, &busiest),
            None
        );
    }

    #[test]
    fn numa_allowance_keeps_a_small_imbalance() {
        let p = DomainParams {
            numa: true,
            share_llc: false,
            imb_numa_nr: 4,
            ..params(true)
        };
        let mut local = group(8, 0, 0, 0, 0);
        local.idle_cpus = 8;
        let mut busiest = group(8, 4, 2048, 2048, 2048);
        busiest.idle_cpus = 4;
        let mut sds = SdTotals::default();
        // idle difference 4 → adjust: dst_running 1 <= 4 and 4 > 2 → 4 → 2.
        let imb = calculate_imbalance(&p, &mut sds, &mut local, &busiest);
        assert_eq!(imb.imbalance, 2);
        // idle difference 2 is allowed: 0.
        busiest.idle_cpus = 6;
        let imb = calculate_imbalance(&p, &mut sds, &mut local, &busiest);
        assert_eq!(imb.imbalance, 0);
    }

    #[test]
    fn a_busy_group_of_bigger_cpus_is_never_the_busiest_for_a_smaller_destination() {
        // Checked before the type comparison: even the first candidate is
        // refused (a fully busy group of 1024-capacity CPUs, destination 512).
        let p = DomainParams {
            asym_cpucapacity: true,
            dst_capacity: 512,
            ..params(true)
        };
        let g = group(2, 2, 2048, 2048, 2048);
        assert_eq!(g.group_type, GroupType::FullyBusy);
        assert!(!update_sd_pick_busiest(
            &p,
            GroupType::HasSpare,
            &SgLbStats::NO_BUSIEST,
            &g
        ));
        // A 1024 destination is not smaller: it may pull.
        let p2 = DomainParams {
            dst_capacity: 1024,
            ..p
        };
        assert!(update_sd_pick_busiest(
            &p2,
            GroupType::HasSpare,
            &SgLbStats::NO_BUSIEST,
            &g
        ));
    }

    #[test]
    fn the_first_smt_group_with_one_task_can_be_the_busiest() {
        // smt_vs_nonsmt_groups() is false without a busiest group: the
        // has-spare rule applies (1 idle CPU < UINT_MAX).
        let p = params(true);
        let mut g = group(2, 1, 500, 500, 500);
        g.smt = true;
        g.idle_cpus = 1;
        assert!(update_sd_pick_busiest(
            &p,
            GroupType::HasSpare,
            &SgLbStats::NO_BUSIEST,
            &g
        ));
        // Against a real non-SMT busiest, the SMT group with one task loses.
        let mut other = group(2, 1, 500, 500, 500);
        other.idle_cpus = 1;
        assert!(!update_sd_pick_busiest(&p, GroupType::HasSpare, &other, &g));
    }

    #[test]
    fn fewer_local_idle_cpus_wrap_like_the_kernels_unsigned_difference() {
        // Busiest overloaded, local has spare, an LLC domain, no
        // prefer_sibling, 4-CPU groups: imbalance = (1 - 2) as unsigned int
        // = 4294967295, >> 1 = 2147483647 tasks.
        let p = params(true);
        let mut local = group(4, 3, 1000, 1000, 1000);
        local.idle_cpus = 1;
        let mut busiest = group(4, 9, 4096, 9000, 9000);
        busiest.idle_cpus = 2;
        assert_eq!(busiest.group_type, GroupType::Overloaded);
        let mut sds = SdTotals::default();
        let imb = calculate_imbalance(&p, &mut sds, &mut local, &busiest);
        assert_eq!(imb.migration_type, MigrationType::Task);
        assert_eq!(imb.imbalance, 2_147_483_647);
    }
}
