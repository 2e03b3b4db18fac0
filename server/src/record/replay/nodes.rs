//! Each node's states rebuilt from a recording, version by version, as the
//! store published them: the recorded CPUs over the previous state, the
//! domain tree built for the online CPUs, the derived values (shared
//! objects, group sums) made again by the engine from the CPUs and the
//! features, exactly as the store makes them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use fairplace_proto::v1 as pb;

use crate::convert;
use crate::engine::cpumask::CpuMask;
use crate::engine::features::{Features, Kernel, System};
use crate::engine::group::NodeAgg;
use crate::engine::rq::TaskTable;
use crate::engine::state::{CpuState, NodeState};
use crate::engine::topology::{FieldError, Topology, TopologySpec};
use crate::store::Snapshot;

/// Versions of a node kept to decide on: a decision names the version it
/// read, which is its node's newest or one of the few before it.
const KEPT: usize = 8;

/// One version as recorded: what every feature setting rebuilds from.
pub struct Version {
    pub version: u64,
    pub topo: Arc<Topology>,
    pub cpus: Vec<CpuState>,
    pub cookies: Vec<u64>,
    pub features: Features,
    /// The agent's report made it.
    pub report: bool,
}

impl Version {
    /// The snapshot the store published for this version, had the node's
    /// features been `features`.
    pub fn snapshot(&self, features: Features) -> Snapshot {
        let mut state = NodeState::new(&self.topo, self.cpus.clone(), &[], &features);
        state.set_core_cookies(&self.topo, self.cookies.clone());
        Snapshot {
            version: self.version,
            agg: NodeAgg::of(&self.topo, &state, features.util_est),
            topo: Arc::clone(&self.topo),
            state,
            features,
            reported_at: None,
            claims: Vec::new(),
            tasks: Arc::new(TaskTable::empty(self.cpus.len())),
        }
    }
}

/// A node in the replay.
pub struct Track {
    pub spec: Arc<TopologySpec>,
    topology: pb::Topology,
    /// The newest versions, oldest first.
    versions: VecDeque<Arc<Version>>,
    /// Domain trees by online CPUs.
    topos: HashMap<CpuMask, Arc<Topology>>,
}

impl Track {
    pub fn version(&self, v: u64) -> Option<&Arc<Version>> {
        self.versions.iter().rev().find(|x| x.version == v)
    }

    pub fn newest(&self) -> Option<&Arc<Version>> {
        self.versions.back()
    }
}

/// Every node of the replay.
pub struct Tracks {
    pub system: System,
    pub tracks: HashMap<String, Track>,
}

impl Tracks {
    pub fn new(system: System) -> Tracks {
        Tracks {
            system,
            tracks: HashMap::new(),
        }
    }

    /// A node as registered. The same hardware again (a keyframe at a
    /// segment's start) keeps its versions; other hardware starts over.
    pub fn node(&mut self, n: &pb::RecordNode) -> Result<(), FieldError> {
        if let Some(t) = self.tracks.get(&n.node_id)
            && n.topology.as_ref() == Some(&t.topology)
        {
            return Ok(());
        }
        let spec = convert::topology_spec(n.topology.as_ref(), "node.topology")?;
        self.tracks.insert(
            n.node_id.clone(),
            Track {
                spec: Arc::new(spec),
                topology: n.topology.clone().unwrap_or_default(),
                versions: VecDeque::new(),
                topos: HashMap::new(),
            },
        );
        Ok(())
    }

    /// A published version; the new version, or why it cannot be built
    /// (the node's registration or its previous state is not recorded).
    pub fn state(&mut self, s: &pb::RecordState) -> Result<Arc<Version>, String> {
        let system = self.system;
        let t = self
            .tracks
            .get_mut(&s.node_id)
            .ok_or_else(|| format!("node {}: a state before its registration", s.node_id))?;
        let prev = t.versions.back().cloned();
        if s.full {
            // A keyframe repeats what is known, or (a version at or below
            // the newest) follows a registration anew.
            if prev.as_ref().is_some_and(|p| p.version >= s.version) {
                t.versions.clear();
            }
        } else if prev.as_ref().is_none_or(|p| p.version >= s.version) {
            return Err(format!(
                "node {} version {}: a change with no recorded state before it",
                s.node_id, s.version
            ));
        }
        let n = t.spec.cpus.len();
        let (mut cpus, mut cookies, mut features) = match (&prev, s.full) {
            (Some(p), false) => (p.cpus.clone(), p.cookies.clone(), p.features),
            _ => (
                t.spec
                    .cpus
                    .iter()
                    .map(|c| CpuState::idle(c.capacity))
                    .collect(),
                Vec::new(),
                Features::default(),
            ),
        };
        for c in &s.cpus {
            let i = c.id as usize;
            if i >= n {
                return Err(format!("node {}: CPU {i} of {n}", s.node_id));
            }
            let st = convert::cpu_state(c, t.spec.cpus[i].capacity)
                .map_err(|(f, m)| format!("node {} cpus[{i}].{f}: {m}", s.node_id))?;
            cpus[i] = st;
            if c.core_cookie != 0 || !cookies.is_empty() {
                cookies.resize(n, 0);
                cookies[i] = c.core_cookie;
            }
        }
        if let Some(f) = &s.features {
            features = features_from_pb(f)?;
        }
        let online = CpuMask::from_cpus((0..n).filter(|&i| cpus[i].online));
        let topo = match t.topos.get(&online) {
            Some(x) => Arc::clone(x),
            None => {
                let x = Arc::new(
                    Topology::build(&t.spec, &online, system.node_reclaim_distance)
                        .map_err(|e| format!("node {}: {e}", s.node_id))?,
                );
                t.topos.insert(online, Arc::clone(&x));
                x
            }
        };
        let v = Arc::new(Version {
            version: s.version,
            topo,
            cpus,
            cookies,
            features,
            report: s.report,
        });
        if t.versions.len() == KEPT {
            t.versions.pop_front();
        }
        t.versions.push_back(Arc::clone(&v));
        Ok(v)
    }
}

/// Features as recorded: the named ones on, the rest off.
pub fn features_from_pb(f: &pb::RecordFeatures) -> Result<Features, String> {
    let kernel = Kernel::from_name(&f.kernel)
        .ok_or_else(|| format!("features.kernel: {:?} is not a kernel profile", f.kernel))?;
    let mut out = Features::for_kernel(kernel);
    for name in crate::engine::features::FEATURE_NAMES {
        out.set(name, false);
    }
    for name in &f.on {
        if !out.set(name, true) {
            return Err(format!(
                "features.on: {name:?} is not a feature this build knows"
            ));
        }
    }
    Ok(out)
}

/// The system switches as recorded.
pub fn system_from_pb(s: &pb::RecordSystem) -> System {
    System {
        uclamp_used: s.uclamp_used,
        core_sched: s.core_sched,
        migration_cost_ns: s.migration_cost_ns,
        node_reclaim_distance: s.node_reclaim_distance,
    }
}
