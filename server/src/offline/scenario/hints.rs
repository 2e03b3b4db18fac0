//! The hints a scenario gives about the kernel's shared state: `llc` and
//! `asym` (each shared object's idle-scan budget and idle-cores flag) and
//! `sgc_imbalance` (the groups whose `sgc->imbalance` is set), each checked
//! against the topology built from the scenario.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use crate::engine::cpumask::CpuMask;
use crate::engine::state::{MAX_SIGNAL, SharedHint};
use crate::engine::topology::{FieldError, Level, SharedKind, SpanId, Topology};
use crate::quote::{field_key, quote};

use super::obj::Obj;

/// One shared object's hint.
fn parse_hint(v: &Value, path: &str) -> Result<SharedHint, FieldError> {
    let o = Obj::new(v, path, &["nr_idle_scan", "has_idle_cores"])?;
    Ok(SharedHint {
        nr_idle_scan: o.int("nr_idle_scan", 0, MAX_SIGNAL)?.map(|x| x as u32),
        has_idle_cores: o.bool("has_idle_cores")?,
    })
}

/// One hint per shared object of `topo`, from `llc` and `asym`.
pub(super) fn parse_hints(
    llc: Option<&Value>,
    asym: Option<&Value>,
    topo: &Topology,
) -> Result<Vec<SharedHint>, FieldError> {
    let mut hints = vec![SharedHint::default(); topo.shared.len()];
    if let Some(v) = llc {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new("llc", "must be an object"))?;
        for (k, val) in map {
            let path = format!("llc.{}", field_key(k));
            let id: u32 = k
                .parse()
                .ok()
                .filter(|id: &u32| id.to_string() == *k)
                .filter(|id| topo.spec.cpus.iter().any(|c| c.llc == *id))
                .ok_or_else(|| {
                    FieldError::new(
                        &path,
                        format!("{} is not an LLC id of the topology", quote(k)),
                    )
                })?;
            let h = parse_hint(val, &path)?;
            // An LLC without a domain has no object: the entry is accepted and ignored.
            for (i, o) in topo.shared.iter().enumerate() {
                if o.kind == SharedKind::Llc && o.live && o.llc == id {
                    hints[i] = h;
                }
            }
        }
    }
    if let Some(v) = asym {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new("asym", "must be an object"))?;
        for (k, val) in map {
            let path = format!("asym.{}", field_key(k));
            let span =
                CpuMask::parse_cpulist(k, topo.nr_cpus).map_err(|e| FieldError::new(&path, e))?;
            let idx = topo
                .shared
                .iter()
                .position(|o| o.kind == SharedKind::Asym && o.live && *topo.span(o.span) == span)
                .ok_or_else(|| {
                    FieldError::new(
                        &path,
                        "is not the span of an asymmetric-capacity shared object",
                    )
                })?;
            hints[idx] = parse_hint(val, &path)?;
        }
    }
    Ok(hints)
}

/// A domain name of section 2 as a level: `NUMA` is the first NUMA level
/// (the kernel names every NUMA level so), `NUMAj` the j-th.
fn parse_level_name(name: &str) -> Option<Level> {
    Some(match name {
        "SMT" => Level::Smt,
        "CLS" => Level::Cls,
        "MC" => Level::Mc,
        "PKG" => Level::Pkg,
        "NODE" => Level::Node,
        "NUMA" => Level::Numa(1),
        _ => {
            let j: u8 = name.strip_prefix("NUMA")?.parse().ok()?;
            if j == 0 || name != format!("NUMA{j}") {
                return None;
            }
            Level::Numa(j)
        }
    })
}

/// Section 6.1: the groups whose `sgc->imbalance` is set, each exactly the
/// span of a group of some online CPU's domain of the named level.
pub(super) fn parse_sgc_imbalance(
    v: Option<&Value>,
    topo: &Topology,
) -> Result<Vec<(Level, SpanId)>, FieldError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let map = v
        .as_object()
        .ok_or_else(|| FieldError::new("sgc_imbalance", "must be an object"))?;
    // The groups of every level's domains by span: one probe per entry,
    // however long the lists are.
    let mut groups: HashMap<(Level, CpuMask), SpanId> = HashMap::new();
    for c in topo.online.iter() {
        for d in topo.domains(c) {
            for &g in d.groups.iter() {
                groups.insert((d.level, *topo.span(g)), g);
            }
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (k, val) in map {
        let path = format!("sgc_imbalance.{}", field_key(k));
        let level = parse_level_name(k).ok_or_else(|| {
            FieldError::new(
                &path,
                format!(
                    "{} is not a domain name (SMT, CLS, MC, PKG, NODE, NUMA, NUMAj)",
                    quote(k)
                ),
            )
        })?;
        let list = val
            .as_array()
            .ok_or_else(|| FieldError::new(&path, "must be a list of cpulists"))?;
        for (i, item) in list.iter().enumerate() {
            let ipath = format!("{path}[{i}]");
            let s = item
                .as_str()
                .ok_or_else(|| FieldError::new(&ipath, "must be a cpulist string"))?;
            let mask =
                CpuMask::parse_cpulist(s, topo.nr_cpus).map_err(|e| FieldError::new(&ipath, e))?;
            let g = groups.get(&(level, mask)).copied().ok_or_else(|| {
                FieldError::new(
                    &ipath,
                    format!("{} is not the span of a group of a {k} domain", quote(s)),
                )
            })?;
            if seen.insert((level, g)) {
                out.push((level, g));
            }
        }
    }
    Ok(out)
}
