//! CPU topology and idle state read from sysfs (normally `/sys/devices/system`).
//!
//! The placement server reasons about a strict hierarchy: CPU ⊂ core ⊂
//! (cluster) ⊂ LLC ⊂ NUMA node. Real sysfs does not always present one:
//! offline CPUs lose their `topology/` and `cache/` directories, Sub-NUMA
//! Clustering makes an L3 span two nodes, and firmware occasionally reports
//! nonsense. [`read_topology`] therefore reads what is there and then applies
//! a small, documented set of fix-ups so that the result is always a proper
//! hierarchy (see [`read_topology`] for the list).
//!
//! Every group id (core, cluster, LLC) is the lowest CPU id in that group, so
//! ids are unique machine-wide and meaningful to a human reading logs,
//! unlike `core_id`, which restarts in every package.
//!
//! Error policy: a missing optional attribute falls back to a default, because
//! kernels, architectures and containers differ in what they expose; a file
//! that exists but cannot be parsed is reported as `InvalidData`, because the
//! kernel never writes garbage and silently guessing would hide a real fault.
//! `ENOENT` and `ENODEV` both count as "missing": kernfs returns `ENODEV` when a
//! CPU is hot-unplugged between opening and reading one of its attributes.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::procfs::parse_digits;

/// One logical CPU as the placement server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuTopo {
    /// Kernel CPU number (the N of `cpuN`).
    pub id: u32,
    /// Whether the CPU is currently online (schedulable).
    pub online: bool,
    /// Lowest CPU id among this CPU's SMT siblings.
    pub core: u32,
    /// Lowest CPU id of the cluster (e.g. CPUs sharing an L2 on hybrid x86 or
    /// an arm64 cluster), or `None` on every CPU when the machine has no
    /// cluster level distinct from both core and LLC.
    pub cluster: Option<u32>,
    /// Lowest CPU id among CPUs sharing this CPU's last-level cache.
    pub llc: u32,
    /// NUMA node id.
    pub node: u32,
    /// Relative compute capacity, 1..=1024 (1024 = the biggest CPU).
    pub capacity: u32,
}

/// The whole machine: every CPU the kernel has a directory for, sorted by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub cpus: Vec<CpuTopo>,
    /// `numa_distance[a][b]` is the ACPI SLIT distance from node `a` to node
    /// `b` (10 = local). `None` on single-node machines and whenever sysfs does
    /// not provide a consistent square matrix indexed by node id.
    pub numa_distance: Option<Vec<Vec<u32>>>,
}

/// Upper bound on any CPU id we accept in a cpulist. The kernel's NR_CPUS
/// tops out at 8192 on current architectures; the bound exists only so that a
/// corrupted list such as "0-4294967295" cannot make us allocate gigabytes.
const MAX_CPU_ID: u32 = (1 << 20) - 1;

/// Parses the kernel's cpulist format ("0-3,8,10-11"; empty means no CPUs).
///
/// Returns the ids sorted and de-duplicated so callers can binary-search.
/// The stride syntax accepted by the kernel on *input* ("0-7:2") is rejected
/// because sysfs never prints it, so seeing it means we read the wrong file.
pub fn parse_cpulist(s: &str) -> Result<Vec<u32>, String> {
    let s = s.trim();
    let mut out: Vec<u32> = Vec::new();
    if s.is_empty() {
        return Ok(out);
    }
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("empty element in cpulist {s:?}"));
        }
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (parse_cpu_id(a, s)?, parse_cpu_id(b, s)?),
            None => {
                let v = parse_cpu_id(part, s)?;
                (v, v)
            }
        };
        if lo > hi {
            return Err(format!("descending range {part:?} in cpulist {s:?}"));
        }
        out.extend(lo..=hi);
        // Keep memory bounded even if a hostile list repeats huge ranges.
        if out.len() > MAX_CPU_ID as usize + 1 {
            out.sort_unstable();
            out.dedup();
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn parse_cpu_id(t: &str, whole: &str) -> Result<u32, String> {
    let t = t.trim();
    // u32::from_str would accept "+3"; the kernel never writes that.
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("bad cpu id {t:?} in cpulist {whole:?}"));
    }
    match t.parse::<u32>() {
        Ok(v) if v <= MAX_CPU_ID => Ok(v),
        _ => Err(format!("cpu id {t:?} out of range in cpulist {whole:?}")),
    }
}

/// Reads `cpu/online`, the authoritative list of schedulable CPUs.
///
/// Unlike [`read_topology`], a missing file is an error here: a caller asking
/// specifically for the online set has no sensible default.
pub fn read_online(sys: &Path) -> io::Result<Vec<u32>> {
    let path = sys.join("cpu/online");
    let text = fs::read_to_string(&path)?;
    parse_cpulist(&text).map_err(|e| invalid(&path, &e))
}

/// Exit latency (µs) of the deepest idle state this CPU may enter.
///
/// sysfs has no "current idle state" file, and the per-state `usage`
/// counters only say what happened in the past, so we report the worst case
/// the CPU can currently be in: the deepest state (highest `stateK`) whose
/// `disable` is 0. That is what a waker may have to pay right now, which is
/// what placement cares about. A state without a `disable` file (very old
/// kernels) counts as enabled; a state without `latency` is skipped.
///
/// `None` when there is no `cpuidle` directory (no cpuidle driver, or an
/// offline CPU), when no state is enabled (the kernel then falls back to the
/// architecture's default idle, whose latency sysfs does not expose), or on
/// any read error — the value is advisory and must never fail a sample.
pub fn idle_exit_latency(sys: &Path, cpu: u32) -> Option<u32> {
    let dir = sys.join(format!("cpu/cpu{cpu}/cpuidle"));
    let names = read_dir_names_opt(&dir).ok()??;
    let mut states: Vec<u32> = names
        .iter()
        .filter_map(|n| n.strip_prefix("state").and_then(parse_digits::<u32>))
        .collect();
    states.sort_unstable();
    for k in states.into_iter().rev() {
        let sd = dir.join(format!("state{k}"));
        let disabled = match read_u32_opt(&sd.join("disable")) {
            Ok(Some(v)) => v != 0,
            Ok(None) => false,
            Err(_) => continue,
        };
        if disabled {
            continue;
        }
        if let Ok(Some(lat)) = read_u32_opt(&sd.join("latency")) {
            return Some(lat);
        }
    }
    None
}

/// Reads the topology of every CPU the kernel has a `cpu/cpuN` directory for.
///
/// Sources, per CPU (first one present wins):
/// * CPU set: `cpu/possible`, else `cpu/present`, restricted to existing
///   `cpuN` directories (VMs often declare far more possible CPUs than exist).
/// * online: `cpu/online`; else the per-CPU `online` file; else online
///   (cpu0 usually has no `online` file because it cannot be unplugged).
/// * core: lowest of `topology/thread_siblings_list` (or its newer name
///   `core_cpus_list`); else the CPU itself.
/// * llc: lowest of `cache/indexK/shared_cpu_list` for the non-Instruction
///   cache with the largest `level` (highest K on ties); else the package
///   (lowest of `package_cpus_list` or `core_siblings_list`); else, if
///   `physical_package_id` is known, the LLC of the lowest CPU of the same
///   package that had cache or package info (this is how offline CPUs on
///   architectures that keep `physical_package_id` get placed); else the
///   CPU's own core.
/// * node: the `node/nodeN/cpulist` that lists the CPU; else the `nodeN`
///   link inside `cpu/cpuN` (x86 drops offline CPUs from node cpulists but
///   keeps the link); else 0.
/// * capacity: `cpu_capacity` clamped to 1..=1024, else 1024.
/// * cluster: see [`CpuTopo::cluster`]; enabled only when every CPU that has a
///   `topology` directory has a non-empty `cluster_cpus_list` (offline CPUs
///   without one are not held against it) and the resulting cluster set of
///   at least one CPU differs from both its core set and its LLC set. Sets,
///   not just lowest ids, are compared, so asymmetric clusters are detected.
///
/// Fix-ups, applied in this order so that each step preserves the previous:
/// 1. Group ids are renumbered to the lowest CPU actually in the group, so a
///    sibling list naming a CPU without a directory cannot leak a bogus id.
/// 2. All CPUs of a core take the node and LLC of the core's lowest CPU
///    (siblings share L1/L2, so disagreement can only be bad data).
/// 3. An LLC spanning several nodes is split per node (each part named by
///    its lowest CPU). This happens for real with Intel Sub-NUMA Clustering,
///    where sysfs shows the L3 shared across the whole socket, and it matches
///    the scheduler, which never builds an LLC domain across nodes.
/// 4. SMT siblings get the minimum capacity of the core, so the server never
///    over-estimates a core because one thread reported more.
/// 5. Clusters are forced to nest: a core takes the cluster of its lowest
///    CPU and a cluster is split along LLC boundaries.
pub fn read_topology(sys: &Path) -> io::Result<Topology> {
    let cpu_root = sys.join("cpu");
    let ids = cpu_ids(&cpu_root)?;
    let online_list = read_list_opt(&cpu_root.join("online"))?;
    let node_of = node_cpulists(sys)?;
    let mut raws = Vec::with_capacity(ids.len());
    for &id in &ids {
        raws.push(read_raw(&cpu_root, id, online_list.as_deref(), &node_of)?);
    }
    Ok(Topology {
        cpus: assemble(&raws),
        numa_distance: read_numa_distance(sys)?,
    })
}

/// Everything read for one CPU before cross-CPU fix-ups.
#[derive(Debug)]
struct Raw {
    id: u32,
    online: bool,
    has_topology: bool,
    core_key: Option<u32>,
    cluster_key: Option<u32>,
    cache_llc: Option<u32>,
    package_id: Option<u32>,
    package_min: Option<u32>,
    node: u32,
    capacity: u32,
}

fn cpu_ids(cpu_root: &Path) -> io::Result<Vec<u32>> {
    let listed = match read_list_opt(&cpu_root.join("possible"))? {
        Some(l) => l,
        None => read_list_opt(&cpu_root.join("present"))?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("neither possible nor present in {}", cpu_root.display()),
            )
        })?,
    };
    let ids: Vec<u32> = listed
        .into_iter()
        .filter(|n| cpu_root.join(format!("cpu{n}")).is_dir())
        .collect();
    if ids.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no cpuN directories under {}", cpu_root.display()),
        ));
    }
    Ok(ids)
}

fn read_raw(
    cpu_root: &Path,
    id: u32,
    online_list: Option<&[u32]>,
    node_of: &BTreeMap<u32, u32>,
) -> io::Result<Raw> {
    let dir = cpu_root.join(format!("cpu{id}"));
    let topo = dir.join("topology");
    let online = match online_list {
        Some(l) => l.binary_search(&id).is_ok(),
        None => read_u32_opt(&dir.join("online"))?.is_none_or(|v| v != 0),
    };
    let core_key = first_list(&[
        topo.join("thread_siblings_list"),
        topo.join("core_cpus_list"),
    ])?
    .and_then(|l| l.first().copied());
    let cluster_key =
        read_list_opt(&topo.join("cluster_cpus_list"))?.and_then(|l| l.first().copied());
    // Some architectures report -1 when the package is unknown.
    let package_id =
        read_i64_opt(&topo.join("physical_package_id"))?.and_then(|v| u32::try_from(v).ok());
    let package_min = first_list(&[
        topo.join("package_cpus_list"),
        topo.join("core_siblings_list"),
    ])?
    .and_then(|l| l.first().copied());
    let node = match node_of.get(&id) {
        Some(&n) => n,
        None => node_link(&dir)?.unwrap_or(0),
    };
    let capacity = read_u32_opt(&dir.join("cpu_capacity"))?.map_or(1024, |c| c.clamp(1, 1024));
    Ok(Raw {
        id,
        online,
        has_topology: topo.is_dir(),
        core_key,
        cluster_key,
        cache_llc: read_cache_llc(&dir.join("cache"))?,
        package_id,
        package_min,
        node,
        capacity,
    })
}

/// Lowest CPU sharing the last-level cache, per the rule in [`read_topology`].
fn read_cache_llc(cache: &Path) -> io::Result<Option<u32>> {
    let Some(names) = read_dir_names_opt(cache)? else {
        return Ok(None);
    };
    // (level, index, lowest sharing CPU)
    let mut best: Option<(u32, u32, u32)> = None;
    for name in names {
        let Some(k) = name.strip_prefix("index").and_then(parse_digits::<u32>) else {
            continue;
        };
        let d = cache.join(&name);
        if read_string_opt(&d.join("type"))?.is_some_and(|t| t.trim() == "Instruction") {
            continue;
        }
        let Some(level) = read_u32_opt(&d.join("level"))? else {
            continue;
        };
        let Some(min) = read_list_opt(&d.join("shared_cpu_list"))?.and_then(|l| l.first().copied())
        else {
            continue;
        };
        if best.is_none_or(|(bl, bk, _)| (level, k) > (bl, bk)) {
            best = Some((level, k, min));
        }
    }
    Ok(best.map(|(_, _, min)| min))
}

/// Map CPU → node from `node/nodeN/cpulist`; the lowest node wins if a CPU is
/// (wrongly) listed twice. Empty when the kernel has no NUMA support.
fn node_cpulists(sys: &Path) -> io::Result<BTreeMap<u32, u32>> {
    let mut map = BTreeMap::new();
    for n in node_ids(sys)? {
        let path = sys.join(format!("node/node{n}/cpulist"));
        if let Some(cpus) = read_list_opt(&path)? {
            for c in cpus {
                map.entry(c).or_insert(n);
            }
        }
    }
    Ok(map)
}

/// Sorted ids of the `node/nodeN` directories.
fn node_ids(sys: &Path) -> io::Result<Vec<u32>> {
    let mut ids: Vec<u32> = read_dir_names_opt(&sys.join("node"))?
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n.strip_prefix("node").and_then(parse_digits::<u32>))
        .collect();
    ids.sort_unstable();
    Ok(ids)
}

/// The node named by a `cpu/cpuN/nodeM` link, which survives CPU offlining.
fn node_link(cpu_dir: &Path) -> io::Result<Option<u32>> {
    Ok(read_dir_names_opt(cpu_dir)?
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n.strip_prefix("node").and_then(parse_digits::<u32>))
        .min())
}

/// Distance rows are printed in online-node order, not by node id, so a
/// matrix is only trustworthy when node ids are exactly 0..n; anything else
/// (sparse ids, ragged rows, unparsable numbers) yields `None` rather than a
/// matrix the server might index wrongly.
fn read_numa_distance(sys: &Path) -> io::Result<Option<Vec<Vec<u32>>>> {
    let ids = node_ids(sys)?;
    let n = ids.len();
    if n <= 1 || ids.iter().enumerate().any(|(i, &id)| id as usize != i) {
        return Ok(None);
    }
    let mut rows = Vec::with_capacity(n);
    for id in ids {
        let Some(text) = read_string_opt(&sys.join(format!("node/node{id}/distance")))? else {
            return Ok(None);
        };
        let row: Result<Vec<u32>, _> = text.split_whitespace().map(str::parse::<u32>).collect();
        match row {
            Ok(r) if r.len() == n => rows.push(r),
            _ => return Ok(None),
        }
    }
    Ok(Some(rows))
}

/// Cross-CPU resolution and the fix-ups documented on [`read_topology`].
/// `raws` is sorted by id (cpulists are parsed sorted).
fn assemble(raws: &[Raw]) -> Vec<CpuTopo> {
    let n = raws.len();
    let ids: Vec<u32> = raws.iter().map(|r| r.id).collect();
    let index_of = |id: u32| {
        ids.binary_search(&id)
            .expect("group ids are member CPU ids")
    };

    // Cores (fix-up 1). After renumbering, core[i] is a member CPU id.
    let core_keys: Vec<u32> = raws.iter().map(|r| r.core_key.unwrap_or(r.id)).collect();
    let core = min_id_by_key(&ids, &core_keys);
    let leader: Vec<usize> = core.iter().map(|&c| index_of(c)).collect();

    // LLC before fix-ups: cache, then package list, then same-package
    // neighbour, then own core.
    let direct: Vec<Option<u32>> = raws.iter().map(|r| r.cache_llc.or(r.package_min)).collect();
    let mut llc_of_package: BTreeMap<u32, u32> = BTreeMap::new();
    for (r, l) in raws.iter().zip(&direct) {
        if let (Some(p), Some(l)) = (r.package_id, l) {
            llc_of_package.entry(p).or_insert(*l); // ids ascend: lowest CPU wins
        }
    }
    let llc0: Vec<u32> = (0..n)
        .map(|i| {
            direct[i]
                .or_else(|| {
                    raws[i]
                        .package_id
                        .and_then(|p| llc_of_package.get(&p).copied())
                })
                .unwrap_or(core[i])
        })
        .collect();

    // Fix-up 2: a core lives in one node and one LLC.
    let node: Vec<u32> = (0..n).map(|i| raws[leader[i]].node).collect();
    let llc1: Vec<u32> = (0..n).map(|i| llc0[leader[i]]).collect();

    // Fix-up 3 (and 1 for LLCs): split per node, renumber.
    let llc_keys: Vec<(u32, u32)> = llc1.iter().copied().zip(node.iter().copied()).collect();
    let llc = min_id_by_key(&ids, &llc_keys);

    // Fix-up 4: SMT siblings share the minimum capacity.
    let mut core_cap: BTreeMap<u32, u32> = BTreeMap::new();
    for i in 0..n {
        let e = core_cap.entry(core[i]).or_insert(raws[i].capacity);
        *e = (*e).min(raws[i].capacity);
    }

    let cluster = clusters(raws, &ids, &core, &leader, &llc);

    (0..n)
        .map(|i| CpuTopo {
            id: ids[i],
            online: raws[i].online,
            core: core[i],
            cluster: cluster.as_ref().map(|c| c[i]),
            llc: llc[i],
            node: node[i],
            capacity: core_cap[&core[i]],
        })
        .collect()
}

/// Cluster ids (fix-up 5), or `None` when there is no distinct cluster level.
fn clusters(
    raws: &[Raw],
    ids: &[u32],
    core: &[u32],
    leader: &[usize],
    llc: &[u32],
) -> Option<Vec<u32>> {
    let with_topo: Vec<&Raw> = raws.iter().filter(|r| r.has_topology).collect();
    if with_topo.is_empty() || with_topo.iter().any(|r| r.cluster_key.is_none()) {
        return None;
    }
    let key0: Vec<u32> = (0..raws.len())
        .map(|i| raws[i].cluster_key.unwrap_or(core[i]))
        .collect();
    let keys: Vec<(u32, u32)> = (0..raws.len()).map(|i| (key0[leader[i]], llc[i])).collect();
    let cluster = min_id_by_key(ids, &keys);
    // Nesting is now guaranteed (core ⊆ cluster ⊆ llc), so comparing group
    // sizes is the same as comparing sets.
    let (cc, cl, cx) = (count(core), count(llc), count(&cluster));
    let distinct =
        (0..raws.len()).any(|i| cx[&cluster[i]] != cc[&core[i]] && cx[&cluster[i]] != cl[&llc[i]]);
    distinct.then_some(cluster)
}

fn count(labels: &[u32]) -> BTreeMap<u32, usize> {
    let mut m = BTreeMap::new();
    for &l in labels {
        *m.entry(l).or_insert(0) += 1;
    }
    m
}

/// For each position, the smallest id among positions with an equal key.
/// This is what turns arbitrary grouping keys into "lowest CPU of the group".
fn min_id_by_key<K: Ord + Clone>(ids: &[u32], keys: &[K]) -> Vec<u32> {
    let mut min: BTreeMap<K, u32> = BTreeMap::new();
    for (&id, k) in ids.iter().zip(keys) {
        let e = min.entry(k.clone()).or_insert(id);
        *e = (*e).min(id);
    }
    keys.iter().map(|k| min[k]).collect()
}

// ---- small file helpers -------------------------------------------------

fn invalid(path: &Path, msg: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {msg}", path.display()),
    )
}

/// ENOENT, or ENODEV from kernfs when the object was removed under us.
fn is_gone(e: &io::Error) -> bool {
    const ENODEV: i32 = 19;
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(ENODEV)
}

fn read_string_opt(path: &Path) -> io::Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if is_gone(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_list_opt(path: &Path) -> io::Result<Option<Vec<u32>>> {
    match read_string_opt(path)? {
        None => Ok(None),
        Some(s) => parse_cpulist(&s).map(Some).map_err(|e| invalid(path, &e)),
    }
}

/// The first of `paths` that exists, parsed as a cpulist; empty lists count
/// as absent so that callers can take `.first()` meaningfully.
fn first_list(paths: &[PathBuf]) -> io::Result<Option<Vec<u32>>> {
    for p in paths {
        if let Some(l) = read_list_opt(p)?
            && !l.is_empty()
        {
            return Ok(Some(l));
        }
    }
    Ok(None)
}

fn read_i64_opt(path: &Path) -> io::Result<Option<i64>> {
    match read_string_opt(path)? {
        None => Ok(None),
        Some(s) => s
            .trim()
            .parse::<i64>()
            .map(Some)
            .map_err(|e| invalid(path, &format!("{e}: {:?}", s.trim()))),
    }
}

fn read_u32_opt(path: &Path) -> io::Result<Option<u32>> {
    match read_i64_opt(path)? {
        None => Ok(None),
        Some(v) => u32::try_from(v)
            .map(Some)
            .map_err(|_| invalid(path, &format!("value {v} out of range"))),
    }
}

fn read_dir_names_opt(dir: &Path) -> io::Result<Option<Vec<String>>> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if is_gone(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut names = Vec::new();
    for entry in rd {
        match entry {
            Ok(e) => {
                if let Some(n) = e.file_name().to_str() {
                    names.push(n.to_owned());
                }
            }
            Err(e) if is_gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_tree::TempTree;
    use std::collections::BTreeSet;

    /// A throw-away sysfs tree (see `temp_tree`).
    struct Fixture {
        root: PathBuf,
        tree: TempTree,
    }

    impl Fixture {
        fn new(tag: &str) -> Self {
            let tree = TempTree::new("sysfs", tag);
            Fixture {
                root: tree.root.clone(),
                tree,
            }
        }
        fn write(&self, rel: &str, content: &str) -> &Self {
            self.tree.put(rel, &format!("{content}\n"));
            self
        }
        fn mkdir(&self, rel: &str) -> &Self {
            self.tree.mkdir(rel);
            self
        }
        fn remove(&self, rel: &str) -> &Self {
            self.tree.remove(rel);
            self
        }
        /// An online CPU with full topology, one data+instruction L1 private
        /// to the core, and a unified L3.
        fn cpu(
            &self,
            id: u32,
            siblings: &str,
            package: u32,
            package_cpus: &str,
            l3: &str,
        ) -> &Self {
            let t = format!("cpu/cpu{id}/topology");
            self.write(&format!("{t}/thread_siblings_list"), siblings)
                .write(&format!("{t}/core_siblings_list"), package_cpus)
                .write(&format!("{t}/package_cpus_list"), package_cpus)
                .write(&format!("{t}/physical_package_id"), &package.to_string());
            self.cache(id, 0, 1, "Data", siblings)
                .cache(id, 1, 1, "Instruction", siblings)
                .cache(id, 2, 3, "Unified", l3)
        }
        fn cache(&self, id: u32, index: u32, level: u32, ty: &str, shared: &str) -> &Self {
            let c = format!("cpu/cpu{id}/cache/index{index}");
            self.write(&format!("{c}/level"), &level.to_string())
                .write(&format!("{c}/type"), ty)
                .write(&format!("{c}/shared_cpu_list"), shared)
        }
        fn topo(&self) -> Topology {
            let t = read_topology(&self.root).unwrap();
            check_invariants(&t);
            t
        }
    }

    /// The guarantees the server relies on, checked on every parsed topology.
    fn check_invariants(t: &Topology) {
        let ids: Vec<u32> = t.cpus.iter().map(|c| c.id).collect();
        assert!(!ids.is_empty());
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted, unique ids");
        let by_id: BTreeMap<u32, &CpuTopo> = t.cpus.iter().map(|c| (c.id, c)).collect();
        let mut core_llc = BTreeMap::new();
        let mut core_cap = BTreeMap::new();
        let mut llc_node = BTreeMap::new();
        let mut cluster_llc = BTreeMap::new();
        let mut core_cluster = BTreeMap::new();
        for c in &t.cpus {
            // Group ids are the lowest member, hence a member, hence ≤ id.
            for g in [c.core, c.llc] {
                assert!(g <= c.id, "{c:?}");
                assert!(by_id.contains_key(&g), "{c:?}");
            }
            assert_eq!(
                by_id[&c.core].core, c.core,
                "core leader is in its own core"
            );
            assert_eq!(by_id[&c.llc].llc, c.llc, "llc leader is in its own llc");
            assert!((1..=1024).contains(&c.capacity));
            assert_eq!(
                *core_llc.entry(c.core).or_insert(c.llc),
                c.llc,
                "core in one llc"
            );
            assert_eq!(
                *core_cap.entry(c.core).or_insert(c.capacity),
                c.capacity,
                "SMT capacity"
            );
            assert_eq!(
                *llc_node.entry(c.llc).or_insert(c.node),
                c.node,
                "llc in one node"
            );
            if let Some(cl) = c.cluster {
                assert!(cl <= c.id && by_id[&cl].cluster == Some(cl));
                assert_eq!(
                    *cluster_llc.entry(cl).or_insert(c.llc),
                    c.llc,
                    "cluster in one llc"
                );
                assert_eq!(
                    *core_cluster.entry(c.core).or_insert(cl),
                    cl,
                    "core in one cluster"
                );
            }
        }
        let with_cluster = t.cpus.iter().filter(|c| c.cluster.is_some()).count();
        assert!(
            with_cluster == 0 || with_cluster == t.cpus.len(),
            "cluster all or nothing"
        );
        if let Some(d) = &t.numa_distance {
            assert!(d.len() > 1 && d.iter().all(|r| r.len() == d.len()));
        }
    }

    fn cores(t: &Topology) -> Vec<u32> {
        t.cpus.iter().map(|c| c.core).collect()
    }
    fn llcs(t: &Topology) -> Vec<u32> {
        t.cpus.iter().map(|c| c.llc).collect()
    }
    fn nodes(t: &Topology) -> Vec<u32> {
        t.cpus.iter().map(|c| c.node).collect()
    }
    fn clusters_of(t: &Topology) -> Vec<Option<u32>> {
        t.cpus.iter().map(|c| c.cluster).collect()
    }

    // ---- parse_cpulist ----

    #[test]
    fn cpulist_ranges_and_singles() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("5").unwrap(), vec![5]);
        assert_eq!(parse_cpulist("7-7").unwrap(), vec![7]);
    }

    #[test]
    fn cpulist_empty_and_whitespace() {
        // cpu/offline is "\n" on a machine with everything online.
        assert_eq!(parse_cpulist("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpulist("\n").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpulist(" 0-1 \n").unwrap(), vec![0, 1]);
    }

    #[test]
    fn cpulist_sorted_and_deduplicated() {
        assert_eq!(parse_cpulist("8,0-2,1,2-3").unwrap(), vec![0, 1, 2, 3, 8]);
    }

    #[test]
    fn cpulist_rejects_malformed() {
        for bad in [
            "3-1",
            "a",
            "1,,2",
            "1,",
            "-1",
            "1-",
            "0-7:2",
            "+1",
            "1 2",
            "0x1",
            "4294967296",
        ] {
            assert!(parse_cpulist(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn cpulist_bounds_huge_ranges() {
        assert!(parse_cpulist("0-4294967295").is_err());
        let max = MAX_CPU_ID.to_string();
        assert_eq!(parse_cpulist(&max).unwrap(), vec![MAX_CPU_ID]);
    }

    // ---- read_online ----

    #[test]
    fn read_online_parses_and_requires_file() {
        let f = Fixture::new("online");
        assert_eq!(
            read_online(&f.root).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        f.write("cpu/online", "0-2,5");
        assert_eq!(read_online(&f.root).unwrap(), vec![0, 1, 2, 5]);
        f.write("cpu/online", "0-x");
        assert_eq!(
            read_online(&f.root).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    // ---- read_topology ----

    /// 1 package, 2 cores × 2 threads with Linux's usual x86 numbering
    /// (siblings are N and N+2), one shared L3.
    #[test]
    fn smt_single_package() {
        let f = Fixture::new("smt");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        f.cpu(0, "0,2", 0, "0-3", "0-3")
            .cpu(1, "1,3", 0, "0-3", "0-3")
            .cpu(2, "0,2", 0, "0-3", "0-3")
            .cpu(3, "1,3", 0, "0-3", "0-3");
        let t = f.topo();
        assert_eq!(cores(&t), vec![0, 1, 0, 1]);
        assert_eq!(llcs(&t), vec![0; 4]);
        assert_eq!(nodes(&t), vec![0; 4]);
        assert!(
            t.cpus
                .iter()
                .all(|c| c.online && c.capacity == 1024 && c.cluster.is_none())
        );
        assert_eq!(t.numa_distance, None);
    }

    /// core_id restarts per package; ids must still be unique machine-wide.
    #[test]
    fn core_ids_unique_across_packages() {
        let f = Fixture::new("pkgs");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        f.cpu(0, "0", 0, "0-1", "0-1")
            .cpu(1, "1", 0, "0-1", "0-1")
            .cpu(2, "2", 1, "2-3", "2-3")
            .cpu(3, "3", 1, "2-3", "2-3");
        for c in 0..4 {
            f.write(
                &format!("cpu/cpu{c}/topology/core_id"),
                &(c % 2).to_string(),
            );
        }
        let t = f.topo();
        assert_eq!(cores(&t), vec![0, 1, 2, 3]);
        assert_eq!(llcs(&t), vec![0, 0, 2, 2]);
    }

    #[test]
    fn core_cpus_list_used_when_thread_siblings_missing() {
        let f = Fixture::new("corecpus");
        f.write("cpu/possible", "0-1").write("cpu/online", "0-1");
        for c in 0..2 {
            f.write(&format!("cpu/cpu{c}/topology/core_cpus_list"), "0-1");
        }
        let t = f.topo();
        assert_eq!(cores(&t), vec![0, 0]);
    }

    /// The L2 is the last level here; Instruction caches never count, and on
    /// equal levels the higher index wins.
    #[test]
    fn llc_picks_highest_level_non_instruction() {
        let f = Fixture::new("llc");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        for c in 0..4 {
            let pair = if c < 2 { "0-1" } else { "2-3" };
            f.write(
                &format!("cpu/cpu{c}/topology/thread_siblings_list"),
                &c.to_string(),
            );
            f.cache(c, 0, 1, "Data", &c.to_string())
                .cache(c, 1, 1, "Instruction", &c.to_string())
                .cache(c, 2, 2, "Unified", pair)
                // A bogus level-3 instruction cache must be ignored.
                .cache(c, 3, 3, "Instruction", "0-3");
        }
        assert_eq!(llcs(&f.topo()), vec![0, 0, 2, 2]);

        // Two caches at the same top level: index 5 (shared 0-3) beats index 4.
        for c in 0..4 {
            f.cache(c, 4, 4, "Unified", &c.to_string())
                .cache(c, 5, 4, "Data", "0-3");
        }
        assert_eq!(llcs(&f.topo()), vec![0; 4]);
    }

    #[test]
    fn cache_without_type_file_counts_as_unified() {
        let f = Fixture::new("notype");
        f.write("cpu/possible", "0-1").write("cpu/online", "0-1");
        for c in 0..2 {
            f.write(&format!("cpu/cpu{c}/cache/index0/level"), "2")
                .write(&format!("cpu/cpu{c}/cache/index0/shared_cpu_list"), "0-1");
        }
        assert_eq!(llcs(&f.topo()), vec![0, 0]);
    }

    #[test]
    fn llc_falls_back_to_package() {
        let f = Fixture::new("pkgfb");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        for c in 0..4u32 {
            let t = format!("cpu/cpu{c}/topology");
            f.write(&format!("{t}/thread_siblings_list"), &c.to_string())
                .write(&format!("{t}/physical_package_id"), &(c / 2).to_string());
            // Older kernels have only core_siblings_list; newer package_cpus_list.
            let list = if c < 2 { "0-1" } else { "2-3" };
            if c % 2 == 0 {
                f.write(&format!("{t}/package_cpus_list"), list);
            } else {
                f.write(&format!("{t}/core_siblings_list"), list);
            }
        }
        assert_eq!(llcs(&f.topo()), vec![0, 0, 2, 2]);
    }

    /// Typical x86: the offline CPU keeps only its directory, `online` file
    /// and `nodeN` link; it is also absent from online CPUs' sibling lists
    /// and from the node cpulist.
    #[test]
    fn offline_cpu_without_topology() {
        let f = Fixture::new("offline");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-2");
        f.cpu(0, "0", 0, "0-2", "0-2")
            .cpu(1, "1", 0, "0-2", "0-2")
            .cpu(2, "2", 0, "0-2", "0-2");
        f.write("cpu/cpu3/online", "0").mkdir("cpu/cpu3/node1");
        f.write("node/node0/cpulist", "0-2")
            .write("node/node1/cpulist", "");
        let t = f.topo();
        let c3 = &t.cpus[3];
        assert!(!c3.online && t.cpus[..3].iter().all(|c| c.online));
        assert_eq!((c3.core, c3.llc, c3.node, c3.cluster), (3, 3, 1, None));
    }

    /// Architectures that keep physical_package_id for offline CPUs let us
    /// put them in the package's LLC.
    #[test]
    fn offline_cpu_with_package_id_joins_package_llc() {
        let f = Fixture::new("offpkg");
        f.write("cpu/possible", "0-5")
            .write("cpu/online", "0-1,3-4");
        f.cpu(0, "0", 0, "0-1", "0-1")
            .cpu(1, "1", 0, "0-1", "0-1")
            .cpu(3, "3", 1, "3-4", "3-4")
            .cpu(4, "4", 1, "3-4", "3-4");
        f.write("cpu/cpu2/topology/physical_package_id", "0")
            .write("cpu/cpu5/topology/physical_package_id", "1");
        let t = f.topo();
        assert_eq!(llcs(&t), vec![0, 0, 0, 3, 3, 3]);
        assert_eq!(cores(&t), vec![0, 1, 2, 3, 4, 5]);
        assert!(!t.cpus[2].online && !t.cpus[5].online);
    }

    #[test]
    fn negative_package_id_is_unknown() {
        let f = Fixture::new("negpkg");
        f.write("cpu/possible", "0-1").write("cpu/online", "0");
        f.write("cpu/cpu0/topology/thread_siblings_list", "0")
            .write("cpu/cpu0/topology/physical_package_id", "-1")
            .write("cpu/cpu0/topology/package_cpus_list", "0")
            .write("cpu/cpu1/topology/physical_package_id", "-1");
        let t = f.topo();
        assert_eq!(llcs(&t), vec![0, 1]);
    }

    #[test]
    fn per_cpu_online_files_when_global_list_missing() {
        let f = Fixture::new("percpu");
        f.write("cpu/possible", "0-2");
        f.mkdir("cpu/cpu0"); // cpu0: no online file → online
        f.write("cpu/cpu1/online", "1")
            .write("cpu/cpu2/online", "0");
        let t = f.topo();
        assert_eq!(
            t.cpus.iter().map(|c| c.online).collect::<Vec<_>>(),
            vec![true, true, false]
        );
    }

    #[test]
    fn cpu_set_from_present_and_existing_dirs_only() {
        let f = Fixture::new("present");
        // possible missing → present; present names a CPU with no directory.
        f.write("cpu/present", "0-2").write("cpu/online", "0-1");
        f.mkdir("cpu/cpu0").mkdir("cpu/cpu1");
        let t = f.topo();
        assert_eq!(t.cpus.iter().map(|c| c.id).collect::<Vec<_>>(), vec![0, 1]);

        // VMs: possible far larger than what exists.
        f.write("cpu/possible", "0-63");
        assert_eq!(f.topo().cpus.len(), 2);
    }

    #[test]
    fn errors_for_missing_cpu_set_or_garbage() {
        let f = Fixture::new("errors");
        assert_eq!(
            read_topology(&f.root).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        f.write("cpu/possible", "0-1");
        assert_eq!(
            read_topology(&f.root).unwrap_err().kind(),
            io::ErrorKind::NotFound,
            "no cpuN dirs"
        );
        f.mkdir("cpu/cpu0").mkdir("cpu/cpu1");
        f.write("cpu/cpu1/topology/thread_siblings_list", "zero");
        assert_eq!(
            read_topology(&f.root).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        f.write("cpu/cpu1/topology/thread_siblings_list", "1")
            .write("cpu/cpu1/cpu_capacity", "big");
        assert_eq!(
            read_topology(&f.root).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        f.remove("cpu/cpu1/cpu_capacity");
        assert!(read_topology(&f.root).is_ok());
    }

    #[test]
    fn capacity_clamped_defaulted_and_smt_min() {
        let f = Fixture::new("cap");
        f.write("cpu/possible", "0-5").write("cpu/online", "0-5");
        let sib = ["0", "1", "2", "3", "4-5", "4-5"];
        for c in 0..6u32 {
            f.write(
                &format!("cpu/cpu{c}/topology/thread_siblings_list"),
                sib[c as usize],
            );
        }
        f.write("cpu/cpu0/cpu_capacity", "446")
            .write("cpu/cpu1/cpu_capacity", "0")
            .write("cpu/cpu2/cpu_capacity", "2048")
            // cpu3: no file → 1024
            .write("cpu/cpu4/cpu_capacity", "1024")
            .write("cpu/cpu5/cpu_capacity", "800");
        let t = f.topo();
        let caps: Vec<u32> = t.cpus.iter().map(|c| c.capacity).collect();
        assert_eq!(caps, vec![446, 1, 1024, 1024, 800, 800]);
    }

    #[test]
    fn numa_nodes_and_distance() {
        let f = Fixture::new("numa");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        f.cpu(0, "0", 0, "0-1", "0-1")
            .cpu(1, "1", 0, "0-1", "0-1")
            .cpu(2, "2", 1, "2-3", "2-3")
            .cpu(3, "3", 1, "2-3", "2-3");
        f.write("node/node0/cpulist", "0-1")
            .write("node/node1/cpulist", "2-3")
            .write("node/node0/distance", "10 21")
            .write("node/node1/distance", "21 10");
        let t = f.topo();
        assert_eq!(nodes(&t), vec![0, 0, 1, 1]);
        assert_eq!(t.numa_distance, Some(vec![vec![10, 21], vec![21, 10]]));

        // Ragged rows → None.
        f.write("node/node1/distance", "21 10 10");
        assert_eq!(f.topo().numa_distance, None);
        // Missing row → None.
        f.remove("node/node1/distance");
        assert_eq!(f.topo().numa_distance, None);
        // Garbage → None (advisory data never fails the read).
        f.write("node/node1/distance", "21 x");
        assert_eq!(f.topo().numa_distance, None);
    }

    #[test]
    fn numa_distance_requires_dense_node_ids_and_several_nodes() {
        let f = Fixture::new("sparse");
        f.write("cpu/possible", "0-1").write("cpu/online", "0-1");
        f.cpu(0, "0", 0, "0", "0").cpu(1, "1", 1, "1", "1");
        f.write("node/node0/cpulist", "0")
            .write("node/node2/cpulist", "1")
            .write("node/node0/distance", "10 20")
            .write("node/node2/distance", "20 10");
        let t = f.topo();
        assert_eq!(nodes(&t), vec![0, 2]);
        assert_eq!(t.numa_distance, None, "rows are not indexable by node id");

        let g = Fixture::new("single");
        g.write("cpu/possible", "0")
            .write("cpu/online", "0")
            .mkdir("cpu/cpu0");
        g.write("node/node0/cpulist", "0")
            .write("node/node0/distance", "10");
        assert_eq!(g.topo().numa_distance, None);
    }

    /// Sub-NUMA Clustering: sysfs shows one L3 over both nodes of a socket.
    #[test]
    fn llc_spanning_nodes_is_split() {
        let f = Fixture::new("snc");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        for c in 0..4 {
            f.cpu(c, &c.to_string(), 0, "0-3", "0-3");
        }
        f.write("node/node0/cpulist", "0,2")
            .write("node/node1/cpulist", "1,3");
        let t = f.topo();
        assert_eq!(llcs(&t), vec![0, 1, 0, 1]);
        assert_eq!(nodes(&t), vec![0, 1, 0, 1]);
    }

    /// Broken firmware: SMT siblings reported in different nodes and LLCs.
    #[test]
    fn core_forced_into_one_node_and_llc() {
        let f = Fixture::new("brokencore");
        f.write("cpu/possible", "0-3").write("cpu/online", "0-3");
        f.cpu(0, "0-1", 0, "0-3", "0")
            .cpu(1, "0-1", 0, "0-3", "1-3")
            .cpu(2, "2", 0, "0-3", "1-3")
            .cpu(3, "3", 0, "0-3", "1-3");
        f.write("node/node0/cpulist", "0,2-3")
            .write("node/node1/cpulist", "1");
        let t = f.topo();
        assert_eq!(cores(&t), vec![0, 0, 2, 3]);
        assert_eq!(nodes(&t), vec![0, 0, 0, 0]);
        assert_eq!(llcs(&t), vec![0, 0, 2, 2]);
    }

    /// A sibling list naming a CPU with no directory must not leak its id.
    #[test]
    fn group_ids_renumbered_to_existing_members() {
        let f = Fixture::new("renumber");
        f.write("cpu/possible", "1-2").write("cpu/online", "1-2");
        f.cpu(1, "0-2", 0, "0-2", "0-2")
            .cpu(2, "0-2", 0, "0-2", "0-2");
        let t = f.topo();
        assert_eq!(cores(&t), vec![1, 1]);
        assert_eq!(llcs(&t), vec![1, 1]);
    }

    fn eight_cpus_one_llc(f: &Fixture) {
        f.write("cpu/possible", "0-7").write("cpu/online", "0-7");
        for c in 0..8 {
            f.cpu(c, &c.to_string(), 0, "0-7", "0-7");
        }
    }

    #[test]
    fn cluster_detected_when_distinct() {
        let f = Fixture::new("cluster");
        eight_cpus_one_llc(&f);
        for c in 0..8 {
            let cl = if c < 4 { "0-3" } else { "4-7" };
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), cl);
        }
        let t = f.topo();
        assert_eq!(clusters_of(&t), [0, 0, 0, 0, 4, 4, 4, 4].map(Some).to_vec());
    }

    #[test]
    fn cluster_none_when_equal_to_core_or_llc() {
        let f = Fixture::new("clusternone");
        eight_cpus_one_llc(&f);
        for c in 0..8 {
            f.write(
                &format!("cpu/cpu{c}/topology/cluster_cpus_list"),
                &c.to_string(),
            );
        }
        assert!(
            clusters_of(&f.topo()).iter().all(Option::is_none),
            "cluster == core"
        );
        for c in 0..8 {
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), "0-7");
        }
        assert!(
            clusters_of(&f.topo()).iter().all(Option::is_none),
            "cluster == llc"
        );
    }

    #[test]
    fn cluster_none_when_file_missing_on_some_cpu() {
        let f = Fixture::new("clustermissing");
        eight_cpus_one_llc(&f);
        for c in 1..8 {
            let cl = if c < 4 { "0-3" } else { "4-7" };
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), cl);
        }
        assert!(clusters_of(&f.topo()).iter().all(Option::is_none));
    }

    /// Clusters {0,1} and {2} inside LLC {0,1,2}: no CPU's lowest-id triple
    /// (core, cluster, llc) is all distinct, yet {0,1} is a real level.
    #[test]
    fn asymmetric_cluster_detected_by_sets() {
        let f = Fixture::new("asym");
        f.write("cpu/possible", "0-2").write("cpu/online", "0-2");
        for c in 0..3 {
            f.cpu(c, &c.to_string(), 0, "0-2", "0-2");
            let cl = if c < 2 { "0-1" } else { "2" };
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), cl);
        }
        assert_eq!(clusters_of(&f.topo()), vec![Some(0), Some(0), Some(2)]);
    }

    /// Offline CPUs (no topology dir) do not disable clusters; they get a
    /// singleton cluster so the all-or-nothing rule holds.
    #[test]
    fn cluster_with_offline_cpu() {
        let f = Fixture::new("clusteroff");
        f.write("cpu/possible", "0-4").write("cpu/online", "0-3");
        for c in 0..4 {
            f.cpu(c, &c.to_string(), 0, "0-3", "0-3");
            let cl = if c < 2 { "0-1" } else { "2-3" };
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), cl);
        }
        f.write("cpu/cpu4/online", "0");
        let t = f.topo();
        assert_eq!(
            clusters_of(&t),
            vec![Some(0), Some(0), Some(2), Some(2), Some(4)]
        );
    }

    /// A cluster list cutting across an SMT core or an LLC is forced to nest.
    #[test]
    fn cluster_forced_to_nest() {
        let f = Fixture::new("nest");
        f.write("cpu/possible", "0-7").write("cpu/online", "0-7");
        let sib = ["0-1", "0-1", "2-3", "2-3", "4-5", "4-5", "6-7", "6-7"];
        for c in 0..8u32 {
            let l3 = if c < 6 { "0-5" } else { "6-7" };
            f.cpu(c, sib[c as usize], 0, "0-7", l3);
            // cpu1 claims a different cluster than its sibling; 4-7 crosses LLCs.
            let cl = match c {
                0 | 2 | 3 => "0,2-3",
                1 => "1",
                _ => "4-7",
            };
            f.write(&format!("cpu/cpu{c}/topology/cluster_cpus_list"), cl);
        }
        let t = f.topo();
        assert_eq!(llcs(&t), vec![0, 0, 0, 0, 0, 0, 6, 6]);
        assert_eq!(clusters_of(&t), [0, 0, 0, 0, 4, 4, 6, 6].map(Some).to_vec());
    }

    // ---- idle_exit_latency ----

    #[test]
    fn idle_latency_of_deepest_enabled_state() {
        let f = Fixture::new("idle");
        let st = |k: u32, lat: u32, dis: u32| {
            f.write(
                &format!("cpu/cpu1/cpuidle/state{k}/latency"),
                &lat.to_string(),
            )
            .write(
                &format!("cpu/cpu1/cpuidle/state{k}/disable"),
                &dis.to_string(),
            )
            .write(&format!("cpu/cpu1/cpuidle/state{k}/usage"), "0");
        };
        st(0, 0, 0);
        st(1, 2, 0);
        st(2, 10, 0);
        st(10, 150, 0); // numeric, not lexical, order
        assert_eq!(idle_exit_latency(&f.root, 1), Some(150));
        st(10, 150, 1);
        assert_eq!(idle_exit_latency(&f.root, 1), Some(10));
        st(2, 10, 1);
        st(1, 2, 1);
        assert_eq!(idle_exit_latency(&f.root, 1), Some(0));
        st(0, 0, 1);
        assert_eq!(idle_exit_latency(&f.root, 1), None, "all disabled");
        // No disable file → enabled; no latency file → skipped.
        f.remove("cpu/cpu1/cpuidle/state2/disable");
        f.remove("cpu/cpu1/cpuidle/state10/latency");
        f.remove("cpu/cpu1/cpuidle/state10/disable");
        assert_eq!(idle_exit_latency(&f.root, 1), Some(10));
    }

    #[test]
    fn idle_latency_none_without_cpuidle() {
        let f = Fixture::new("noidle");
        f.mkdir("cpu/cpu0");
        assert_eq!(idle_exit_latency(&f.root, 0), None);
        assert_eq!(idle_exit_latency(&f.root, 7), None);
        f.mkdir("cpu/cpu0/cpuidle");
        assert_eq!(idle_exit_latency(&f.root, 0), None);
    }

    // ---- the real machine ----

    /// Reads this machine's sysfs and checks only invariants that hold on
    /// any Linux box, so it is stable across hardware.
    #[test]
    fn real_machine_invariants() {
        let sys = Path::new("/sys/devices/system");
        if !sys.join("cpu/online").exists() {
            eprintln!("no sysfs; skipping");
            return;
        }
        let t = read_topology(sys).unwrap();
        check_invariants(&t);
        let online = read_online(sys).unwrap();
        assert!(!online.is_empty(), "at least one CPU online");
        let ids: BTreeSet<u32> = t.cpus.iter().map(|c| c.id).collect();
        for id in &online {
            assert!(ids.contains(id), "online CPU {id} has a directory");
        }
        for c in &t.cpus {
            assert_eq!(c.online, online.contains(&c.id));
        }
        // Every CPU is in exactly one core: the core relation partitions.
        let mut seen = BTreeSet::new();
        let mut by_core: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for c in &t.cpus {
            by_core.entry(c.core).or_default().push(c.id);
        }
        for members in by_core.values() {
            for m in members {
                assert!(seen.insert(*m));
            }
        }
        assert_eq!(seen, ids);
        // Calling this must not panic whatever the machine has.
        for c in &t.cpus {
            let _ = idle_exit_latency(sys, c.id);
        }
    }
}
