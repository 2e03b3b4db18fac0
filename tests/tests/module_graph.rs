//! The map stays acyclic: no module of a crate uses one that uses it back
//! (through any chain), and the server's engine uses nothing of the crate
//! outside itself.
//!
//! The graph is read from the source text, as a reader meets it: every
//! `crate::`, `super::` and `self::` path in a module's non-test code
//! (before its first `#[cfg(test)]`), doc links included, resolved to the
//! deepest module it names. A use between a module and its own ancestor is
//! not an edge (a parent declares its children); any other use is an edge
//! between the two children of their closest common ancestor, so a cycle
//! anywhere shows as a cycle among siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// The crates' source folders, from the workspace root.
const CRATES: &[&str] = &[
    "server/src",
    "client/src",
    "host/src",
    "cli/src",
    "integrations/slurm/src",
    "client/agent/src",
    "types/src",
    "proto/src",
    "benches/src",
    "demo/src",
    "tests/src",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Every library module file of the crate (binaries' own files aside: they
/// use the crate by name).
fn module_files(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read src").flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "bin") {
                    dirs.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut m: Module = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if d == src && m.last().is_some_and(|l| l == "main") {
                continue;
            }
            if m.last().is_some_and(|l| l == "mod" || l == "lib") {
                m.pop();
            }
            out.insert(m, p);
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The `crate::`/`super::`/`self::` paths in `text`, each as its segments
/// (a `::{a, b::c}` group gives one path per member).
fn paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts = ["crate::", "super::", "self::"]
            .iter()
            .any(|k| b[i..].starts_with(k.as_bytes()))
            && (i == 0 || !is_ident(b[i - 1] as char));
        if !starts {
            i += 1;
            continue;
        }
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let s = j;
            while j < b.len() && is_ident(b[j] as char) {
                j += 1;
            }
            segs.push(text[s..j].to_string());
            if b[j..].starts_with(b"::{") {
                let end = b[j..]
                    .iter()
                    .position(|c| *c == b'}')
                    .map_or(b.len(), |e| j + e);
                for member in text[j + 3..end].split(',') {
                    let member = member.split(" as ").next().unwrap_or("").trim();
                    let first: Vec<String> = member
                        .split("::")
                        .take_while(|s| !s.starts_with('{') && !s.is_empty())
                        .map(str::to_string)
                        .collect();
                    if !first.is_empty() && first[0] != "self" {
                        out.push([segs.clone(), first].concat());
                    }
                }
                j = end;
                segs.clear();
                break;
            }
            if b[j..].starts_with(b"::") && b.get(j + 2).is_some_and(|c| is_ident(*c as char)) {
                j += 2;
                continue;
            }
            break;
        }
        if !segs.is_empty() {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// The deepest module `path`, used from module `me`, names.
fn resolve(me: &Module, path: &[String], mods: &BTreeSet<Module>) -> Option<Module> {
    let (mut base, rest) = match path[0].as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (me.clone(), &path[1..]),
        _ => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let keep = me.len().checked_sub(ups)?;
            (me[..keep].to_vec(), &path[ups..])
        }
    };
    let mut best = mods.contains(&base).then(|| base.clone());
    for s in rest {
        base.push(s.clone());
        if mods.contains(&base) {
            best = Some(base.clone());
        }
    }
    best
}

/// The edges between siblings, each with the use that made it.
fn sibling_edges(src: &Path) -> BTreeMap<(Module, Module), String> {
    let files = module_files(src);
    let mods: BTreeSet<Module> = files.keys().cloned().collect();
    let mut edges = BTreeMap::new();
    for (me, file) in &files {
        let text = std::fs::read_to_string(file).expect("read module");
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for p in paths(text) {
            let Some(to) = resolve(me, &p, &mods) else {
                continue;
            };
            let common = me.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == me.len() || common == to.len() {
                continue; // itself, an ancestor or a descendant
            }
            let a = me[..=common].to_vec();
            let b = to[..=common].to_vec();
            edges
                .entry((a, b))
                .or_insert_with(|| format!("{} uses {}", me.join("::"), p.join("::")));
        }
    }
    edges
}

/// The strongly connected groups of more than one module (Tarjan).
fn cycles(edges: &BTreeMap<(Module, Module), String>) -> Vec<Vec<Module>> {
    let mut adj: BTreeMap<&Module, Vec<&Module>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        adj.entry(a).or_default().push(b);
        adj.entry(b).or_default();
    }
    struct T<'a> {
        adj: &'a BTreeMap<&'a Module, Vec<&'a Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Module) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for &w in &t.adj[v] {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut group = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                group.push(w.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                t.out.push(group);
            }
        }
    }
    let mut t = T {
        adj: &adj,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in adj.keys() {
        if !t.index.contains_key(*v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_module_uses_one_that_uses_it_back() {
    let mut found = Vec::new();
    for krate in CRATES {
        let src = root().join(krate);
        let edges = sibling_edges(&src);
        assert!(!edges.is_empty() || *krate != "server/src", "no edges read");
        for group in cycles(&edges) {
            let names: Vec<String> = group.iter().map(|m| m.join("::")).collect();
            let why: Vec<&String> = edges
                .iter()
                .filter(|((a, b), _)| group.contains(a) && group.contains(b))
                .map(|(_, w)| w)
                .collect();
            found.push(format!("{krate}: {} ({why:?})", names.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

#[test]
fn the_engine_uses_nothing_of_the_server_outside_itself() {
    let src = root().join("server/src");
    let outside: Vec<String> = sibling_edges(&src)
        .into_iter()
        .filter(|((a, b), _)| a[0] == "engine" && b[0] != "engine")
        .map(|(_, why)| why)
        .collect();
    assert!(outside.is_empty(), "the engine reaches out: {outside:?}");
}

#[test]
fn the_reader_sees_a_cycle_and_an_impure_engine_when_there_is_one() {
    // The graph reader itself, on a crate made for it: a <-> b through a
    // grouped use and a doc link, c only under a test module, and an
    // engine that reaches the store.
    let dir = std::env::temp_dir().join(format!("fairplace-modgraph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("engine")).unwrap();
    let write = |f: &str, t: &str| std::fs::write(dir.join(f), t).unwrap();
    write(
        "lib.rs",
        "pub mod a;\npub mod b;\npub mod c;\npub mod engine;\npub mod store;\n",
    );
    write("a.rs", "use crate::{b::Thing, store};\n");
    write("b.rs", "//! See [`super::a`].\n");
    write("c.rs", "#[cfg(test)]\nmod tests { use crate::a; }\n");
    write("store.rs", "");
    write("engine/mod.rs", "pub mod inner;\n");
    write("engine/inner.rs", "use super::super::store::Store;\n");
    let edges = sibling_edges(&dir);
    let c = cycles(&edges);
    assert_eq!(c, vec![vec![vec!["a".to_string()], vec!["b".to_string()]]]);
    assert!(!edges.keys().any(|(a, _)| a[0] == "c"), "{edges:?}");
    assert!(
        edges.contains_key(&(vec!["engine".into()], vec!["store".into()])),
        "{edges:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
