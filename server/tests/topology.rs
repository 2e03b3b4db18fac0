//! The sched-domain tree, worked out by hand from the kernel's rules
//! (scenario format section 2.1, kernel-algorithms section T).

use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::topology::{CpuTopo, Level, SharedKind, Topology, TopologySpec, sd};

/// Packed numbering: node, then LLC, then cluster, then core, then thread.
fn machine(
    nodes: u32,
    llcs: u32,
    clusters: Option<u32>,
    cores: u32,
    smt: u32,
    caps: impl Fn(u32) -> u32,
) -> TopologySpec {
    let mut cpus = vec![];
    let per_cluster = clusters.map(|c| cores / c);
    for node in 0..nodes {
        for l in 0..llcs {
            let llc = node * llcs + l;
            for c in 0..cores {
                let core = llc * cores + c;
                for _ in 0..smt {
                    cpus.push(CpuTopo {
                        core,
                        cluster: per_cluster.map(|p| llc * 1000 + c / p),
                        llc,
                        node,
                        capacity: caps(core),
                    });
                }
            }
        }
    }
    TopologySpec {
        cpus,
        numa_distance: None,
    }
}

fn all(spec: &TopologySpec) -> CpuMask {
    CpuMask::first_n(spec.cpus.len())
}

fn levels(t: &Topology, cpu: usize) -> Vec<String> {
    t.domains(cpu).iter().map(|d| d.level.to_string()).collect()
}

fn m(s: &str) -> CpuMask {
    CpuMask::parse_cpulist(s, 4096).unwrap()
}

#[test]
fn two_nodes_one_llc_each_keep_smt_mc_and_numa() {
    // 2 nodes x 1 LLC x 4 cores x SMT2 = 16 CPUs. PKG and NODE span the same
    // CPUs as MC with a subset of its flags, so both degenerate; NUMA1 spans
    // both nodes at distance 20.
    let spec = machine(2, 1, None, 4, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["SMT", "MC", "NUMA1"]);
    let d = t.domains(0);
    assert_eq!((d[0].imbalance_pct, d[0].cache_nice_tries), (110, 0));
    assert_eq!((d[1].imbalance_pct, d[1].cache_nice_tries), (117, 1));
    assert_eq!((d[2].imbalance_pct, d[2].cache_nice_tries), (117, 2));
    assert!(d[2].has(sd::NUMA) && d[2].has(sd::SERIALIZE) && !d[2].has(sd::PREFER_SIBLING));
    assert!(d[2].has(sd::WAKE_AFFINE) && d[2].has(sd::BALANCE_FORK));
    assert_eq!(*t.span(d[1].span), m("0-7"));
    // MC's groups are the cores, local first, then by first CPU, wrapping.
    let groups: Vec<String> = t.domains(5)[1]
        .groups
        .iter()
        .map(|g| t.span(*g).to_string())
        .collect();
    assert_eq!(groups, ["4-5", "6-7", "0-1", "2-3"]);
    // NUMA1's groups are the nodes, local node first.
    let groups: Vec<String> = t.domains(9)[2]
        .groups
        .iter()
        .map(|g| t.span(*g).to_string())
        .collect();
    assert_eq!(groups, ["8-15", "0-7"]);
    assert_eq!(t.sd_llc(0).unwrap().level, Level::Mc);
    assert_eq!(t.llc_size(3), 8);
    assert!(t.smt_active && !t.asym_active && !t.cluster_active);
    assert!(t.cpus_share_cache(0, 7) && !t.cpus_share_cache(7, 8));
}

#[test]
fn imb_numa_nr_follows_llcs_per_node() {
    // B.6: two LLCs per node gives imb_numa_nr 2 at the first level above
    // the LLC; the span unit is the first NUMA domain (64 CPUs), so NUMA1
    // gets 2 * max(1, 64 / 64) = 2. One 32-CPU LLC per node gives 32 >> 3 = 4.
    let spec = machine(2, 2, None, 8, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["SMT", "MC", "PKG", "NUMA1"]);
    let d = t.domains(0);
    assert_eq!(d[2].imb_numa_nr, 2);
    assert_eq!(d[3].imb_numa_nr, 2);
    assert_eq!(d[0].imb_numa_nr + d[1].imb_numa_nr, 0);

    let spec = machine(2, 1, None, 16, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    // PKG (the parent of the LLC) degenerates, but NUMA1 keeps 4 * (64/64).
    assert_eq!(levels(&t, 0), ["SMT", "MC", "NUMA1"]);
    assert_eq!(t.domains(0)[2].imb_numa_nr, 4);
}

#[test]
fn smt1_loses_the_smt_level_and_a_one_cpu_node_has_no_domains() {
    let spec = machine(1, 1, None, 4, 1, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 2), ["MC"]);
    assert!(!t.smt_active);
    // MC's first group lost its child, so its flags were cleared.
    assert_eq!(t.domains(2)[0].first_group_flags, 0);

    let spec = machine(1, 1, None, 1, 1, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert!(t.domains(0).is_empty());
    assert!(t.sd_llc(0).is_none());
    assert_eq!(t.llc_size(0), 1);
}

#[test]
fn clusters_survive_only_when_distinct_from_core_and_llc() {
    // 8 cores of SMT2 in clusters of 2 cores: CLS survives and MC's first
    // group (the target's cluster) carries CLUSTER.
    let spec = machine(1, 1, Some(4), 8, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["SMT", "CLS", "MC"]);
    assert!(t.cluster_active);
    let mc = t.sd_llc(5).unwrap();
    assert_eq!(mc.level, Level::Mc);
    assert_ne!(mc.first_group_flags & sd::CLUSTER, 0);
    assert_eq!(*t.span(mc.groups[0]), m("4-7"));
    // share_id: the first CPU of the cluster.
    assert!(t.cpus_share_resources(4, 7) && !t.cpus_share_resources(3, 4));

    // A cluster per core: CLS degenerates into SMT, and MC's first group
    // takes SMT's flags (no CLUSTER).
    let spec = machine(1, 1, Some(8), 8, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["SMT", "MC"]);
    assert!(!t.cluster_active);
    assert_eq!(t.sd_llc(0).unwrap().first_group_flags & sd::CLUSTER, 0);

    // One cluster per LLC: MC degenerates into CLS, which is then the LLC
    // domain; its first group is a core, so the cluster phase is skipped.
    let spec = machine(1, 1, Some(1), 8, 2, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["SMT", "CLS"]);
    let llc = t.sd_llc(0).unwrap();
    assert_eq!(llc.level, Level::Cls);
    assert!(t.cluster_active);
    assert_eq!(llc.first_group_flags & sd::CLUSTER, 0);
    assert_eq!(t.shared[llc.shared.unwrap() as usize].kind, SharedKind::Llc);
}

#[test]
fn offline_cpus_leave_every_span() {
    let spec = machine(1, 2, None, 2, 2, |_| 1024);
    let mut online = all(&spec);
    online.clear(1);
    online.clear(4);
    online.clear(5);
    let t = Topology::build(&spec, &online, 30).unwrap();
    assert!(t.domains(1).is_empty());
    // CPU 0 lost its sibling: the SMT level is one CPU and goes.
    assert_eq!(levels(&t, 0), ["MC", "PKG"]);
    assert_eq!(*t.span(t.domains(0)[0].span), m("0,2-3"));
    // LLC 1 has CPUs 6-7 online only; they form one core, so the SMT and MC
    // levels coincide and MC (a subset of SMT's flags) degenerates into SMT,
    // which becomes the LLC domain and takes the LLC shared object.
    assert_eq!(levels(&t, 6), ["SMT", "PKG"]);
    let llc = t.sd_llc(6).unwrap();
    assert_eq!(llc.level, Level::Smt);
    let obj = &t.shared[llc.shared.unwrap() as usize];
    assert_eq!((obj.weight, obj.imbalance_pct), (2, 110));
    assert!(t.cpus_share_cache(1, 4), "offline CPUs all share id -1");
    assert!(!t.cpus_share_cache(0, 1));
    assert_eq!(t.smt_siblings(0), &[0]);
    assert!(t.smt_siblings(1).is_empty());
}

#[test]
fn far_numa_levels_lose_fork_exec_balance_and_wake_affine() {
    // Four nodes in a line of distances: 0-1 at 20, 0-2 at 40, 0-3 at 40...
    let mut spec = machine(4, 1, None, 2, 1, |_| 1024);
    spec.numa_distance = Some(vec![
        vec![10, 20, 40, 40],
        vec![20, 10, 40, 40],
        vec![40, 40, 10, 20],
        vec![40, 40, 20, 10],
    ]);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(t.distances, vec![10, 20, 40]);
    assert_eq!(levels(&t, 0), ["MC", "NUMA1", "NUMA2"]);
    let d = t.domains(0);
    assert!(d[1].has(sd::WAKE_AFFINE) && d[1].has(sd::BALANCE_EXEC));
    assert!(
        !d[2].has(sd::WAKE_AFFINE) && !d[2].has(sd::BALANCE_FORK) && !d[2].has(sd::BALANCE_EXEC)
    );
    assert_eq!(*t.span(d[1].span), m("0-3"));
    // NUMA2's groups are the NUMA1 spans of the two pairs, local first.
    let groups: Vec<String> = d[2].groups.iter().map(|g| t.span(*g).to_string()).collect();
    assert_eq!(groups, ["0-3", "4-7"]);
    // With a larger reclaim distance NUMA2 keeps them.
    let t = Topology::build(&spec, &all(&spec), 40).unwrap();
    assert!(t.domains(0)[2].has(sd::WAKE_AFFINE));
}

#[test]
fn asymmetric_capacity_gets_asym_flags_and_its_own_shared_object() {
    // One LLC of 4 big (1024) and 4 little (512) single-thread cores.
    let spec = machine(1, 1, None, 8, 1, |core| if core < 4 { 1024 } else { 512 });
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert!(t.asym_active);
    let mc = &t.domains(0)[0];
    assert!(mc.has(sd::ASYM_CPUCAPACITY) && mc.has(sd::ASYM_CPUCAPACITY_FULL));
    // The asym domain is the LLC domain: the LLC object overwrote the asym one.
    let asym = t.sd_asym(0).unwrap();
    assert_eq!(
        t.shared[asym.shared.unwrap() as usize].kind,
        SharedKind::Llc
    );

    // Two LLCs (big cluster, little cluster) in one node: PKG is the
    // asym-full domain and owns an asym object distinct from the LLC ones.
    let spec = machine(1, 2, None, 4, 1, |core| if core < 4 { 1024 } else { 512 });
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 0), ["MC", "PKG"]);
    let pkg = t.sd_asym(0).unwrap();
    assert_eq!(pkg.level, Level::Pkg);
    let obj = &t.shared[pkg.shared.unwrap() as usize];
    assert_eq!(obj.kind, SharedKind::Asym);
    assert_eq!(*t.span(obj.span), m("0-7"));
    assert!(!t.domains(0)[0].has(sd::ASYM_CPUCAPACITY));
    // The asym parent took PREFER_SIBLING off its child.
    assert!(!t.domains(0)[0].has(sd::PREFER_SIBLING));
    assert_eq!(t.cpu[0].balance_shared, pkg.shared);
}

#[test]
fn smt8_cores_are_groups_of_eight() {
    let spec = machine(1, 1, None, 4, 8, |_| 1024);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(levels(&t, 9), ["SMT", "MC"]);
    assert_eq!(t.smt_siblings(9), &[8, 9, 10, 11, 12, 13, 14, 15]);
    assert_eq!(t.domains(9)[1].groups.len(), 4);
}

#[test]
fn interleaved_numbering_builds_the_same_shape() {
    // x86 style: CPUs 0-3 are first threads, 4-7 their siblings.
    let cpus = (0..8)
        .map(|i| CpuTopo {
            core: i % 4,
            cluster: None,
            llc: 0,
            node: 0,
            capacity: 1024,
        })
        .collect();
    let spec = TopologySpec {
        cpus,
        numa_distance: None,
    };
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(*t.smt_mask(1), m("1,5"));
    let groups: Vec<String> = t.domains(5)[1]
        .groups
        .iter()
        .map(|g| t.span(*g).to_string())
        .collect();
    // Local group {1,5} first, then by the walk from CPU 5: 6 -> {2,6}, 7 -> {3,7}, 0 -> {0,4}.
    assert_eq!(groups, ["1,5", "2,6", "3,7", "0,4"]);
}

#[test]
fn inconsistent_topologies_are_rejected_naming_the_field() {
    let base = machine(1, 2, None, 2, 2, |_| 1024);
    let check = |f: &dyn Fn(&mut TopologySpec), field: &str| {
        let mut s = base.clone();
        f(&mut s);
        let e = Topology::build(&s, &all(&s), 30).unwrap_err();
        assert_eq!(e.field, field, "{e}");
    };
    check(&|s| s.cpus[3].llc = 1, "topology.cpus[3].llc"); // core 1 across two LLCs
    check(&|s| s.cpus[1].node = 1, "topology.cpus[1].node"); // a core in two nodes
    check(&|s| s.cpus[2].capacity = 0, "topology.cpus[2].capacity");
    check(&|s| s.cpus[2].capacity = 1025, "topology.cpus[2].capacity");
    check(&|s| s.cpus[1].capacity = 512, "topology.cpus[1].capacity"); // siblings differ
    check(&|s| s.cpus[0].cluster = Some(0), "topology.cpus[1].cluster"); // some CPUs only
    check(
        &|s| {
            for c in s.cpus.iter_mut() {
                c.cluster = Some(c.core);
            }
            s.cpus[4].cluster = Some(0);
            s.cpus[5].cluster = Some(0);
        },
        "topology.cpus[4].llc",
    ); // a cluster across two LLCs
    check(
        &|s| {
            s.cpus[4].node = 1;
            s.cpus[5].node = 1;
            s.cpus[6].node = 0;
        },
        "topology.cpus[6].node",
    ); // LLC 1 across two nodes (and core 3 too: the LLC is seen first)
    check(
        &|s| s.numa_distance = Some(vec![vec![10], vec![10]]),
        "topology.numa_distance",
    );
    check(
        &|s| s.numa_distance = Some(vec![vec![12]]),
        "topology.numa_distance[0][0]",
    );
    check(&|s| s.cpus.clear(), "topology.cpus");
}

#[test]
fn group_rings_follow_the_kernels_shared_groups() {
    // Cores A = {0,4}, B = {1,3}, C = {2,5} in one LLC. The MC groups are
    // shared objects whose ring is rewritten by every CPU's build, the last
    // (CPU 5) leaving the order of wrap(0-5, 5): C, A, B. CPU 3 enters it at
    // its own group B: B, C, A (the format's wrap from CPU 3 would say B, A, C).
    let cores = [0, 1, 2, 1, 0, 2];
    let cpus = cores
        .iter()
        .map(|&core| CpuTopo {
            core,
            cluster: None,
            llc: 0,
            node: 0,
            capacity: 1024,
        })
        .collect();
    let spec = TopologySpec {
        cpus,
        numa_distance: None,
    };
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    let ring = |cpu: usize| -> Vec<String> {
        t.domains(cpu)[1]
            .groups
            .iter()
            .map(|g| t.span(*g).to_string())
            .collect()
    };
    assert_eq!(ring(3), ["1,3", "2,5", "0,4"]);
    assert_eq!(ring(0), ["0,4", "1,3", "2,5"]);
    assert_eq!(ring(5), ["2,5", "0,4", "1,3"]);
}

/// The hardening issue's node: 4,096 CPUs, each its own core and LLC, 16 per
/// NUMA node (256 nodes), with the distances `d`.
fn node_4096(d: impl Fn(u32, u32) -> u32) -> TopologySpec {
    let cpus = (0..4096u32)
        .map(|c| CpuTopo {
            core: c,
            cluster: None,
            llc: c,
            node: c / 16,
            capacity: 1024,
        })
        .collect();
    TopologySpec {
        cpus,
        numa_distance: Some(
            (0..256u32)
                .map(|a| (0..256u32).map(|b| d(a, b)).collect())
                .collect(),
        ),
    }
}

/// A large machine's tiers: 10 local, 16 within a blade of 4 nodes, 22
/// within a rack of 32, then 28 + 2 per rack hop (11 distinct distances).
fn tiers(a: u32, b: u32) -> u32 {
    if a == b {
        10
    } else if a / 4 == b / 4 {
        16
    } else if a / 32 == b / 32 {
        22
    } else {
        28 + 2 * (a / 32).abs_diff(b / 32)
    }
}

#[test]
fn the_4096_cpu_256_node_topology_builds() {
    let spec = node_4096(tiers);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(t.distances, [10, 16, 22, 30, 32, 34, 36, 38, 40, 42]);
    // Single-CPU SMT and MC levels and NODE (the same span as PKG) go; the
    // node, the blade, the rack and each rack hop stay, up to the level
    // that spans the machine (7 hops from rack 0).
    assert_eq!(
        levels(&t, 100),
        [
            "PKG", "NUMA1", "NUMA2", "NUMA3", "NUMA4", "NUMA5", "NUMA6", "NUMA7", "NUMA8", "NUMA9"
        ]
    );
    let d = t.domains(100);
    assert_eq!(*t.span(d[0].span), m("96-111"));
    assert_eq!(*t.span(d[1].span), m("64-127"));
    assert_eq!(*t.span(d[2].span), m("0-511"));
    assert_eq!(*t.span(d[3].span), m("0-1023"));
    assert_eq!(d.last().unwrap().weight, 4096);
    // PKG's groups are its CPUs, the ring of the shared groups entered at
    // CPU 100; NUMA1's are the blade's nodes, local node first, then in the
    // order of the walk from CPU 100.
    assert_eq!(d[0].groups.len(), 16);
    assert_eq!(*t.span(d[0].groups[0]), m("100"));
    assert_eq!(*t.span(d[0].groups[1]), m("101"));
    let blade: Vec<String> = d[1].groups.iter().map(|g| t.span(*g).to_string()).collect();
    assert_eq!(blade, ["96-111", "112-127", "64-79", "80-95"]);
    // A CPU of a middle rack (4) reaches the whole machine in 4 hops, at
    // NUMA6; its tree stops there.
    assert_eq!(t.domains(2048).len(), 7);
    assert_eq!(t.domains(2048)[6].weight, 4096);
    // The top level far beyond the reclaim distance: no wake affinity.
    assert!(!d.last().unwrap().has(sd::WAKE_AFFINE));
    // One LLC object per CPU; every CPU the only one of its LLC.
    assert_eq!(t.shared.len(), 4096);
    assert!(t.sd_llc(100).is_none() && t.llc_size(100) == 1);
    // CPUs of one node share every ring above the node.
    let top = |c: usize| t.domains(c).last().unwrap().groups.to_vec();
    assert_eq!(top(96), top(111));
}

#[test]
fn too_many_numa_distances_are_refused_naming_the_field() {
    use fairplace::engine::topology::MAX_NUMA_DISTANCES;
    // Distances growing with the node ids' difference: 122 distinct values,
    // a NUMA level each.
    let spec = node_4096(|a, b| (10 + 2 * a.abs_diff(b)).min(254));
    let e = Topology::build(&spec, &all(&spec), 30).unwrap_err();
    assert_eq!(e.field, "topology.numa_distance", "{e}");
    assert!(e.msg.contains("122 distinct distances"), "{e}");

    // Exactly the limit builds, one more is refused: 256 nodes on a ring,
    // 2 more per hop up to `levels` hops.
    let ring = |levels: u32| {
        node_4096(move |a, b| {
            let hops = a.abs_diff(b).min(256 - a.abs_diff(b));
            if a == b {
                10
            } else {
                10 + 2 * hops.min(levels)
            }
        })
    };
    let limit = MAX_NUMA_DISTANCES as u32;
    let spec = ring(limit);
    let t = Topology::build(&spec, &all(&spec), 30).unwrap();
    assert_eq!(t.distances.len(), MAX_NUMA_DISTANCES + 1);
    let spec = ring(limit + 1);
    let e = Topology::build(&spec, &all(&spec), 30).unwrap_err();
    assert_eq!(e.field, "topology.numa_distance", "{e}");
}
