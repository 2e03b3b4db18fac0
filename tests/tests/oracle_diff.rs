//! Differential test: the engine against the independent Python reference
//! implementation of the scenario format (tests/oracle/oracle.py), on random
//! scenarios from tests/oracle/gen.py (SMT1 to SMT8, 1 to 4 LLCs, clusters,
//! 1 to 4 NUMA nodes, asymmetric capacities, offline CPUs, every request kind
//! and switch). Every compared field must agree.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn oracle_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("oracle")
}

fn python(args: &[&str], stdin_file: Option<&PathBuf>) -> String {
    let mut cmd = Command::new("python3");
    cmd.args(args).current_dir(oracle_dir());
    if let Some(f) = stdin_file {
        cmd.stdin(std::fs::File::open(f).unwrap());
    }
    let out = cmd.output().expect("python3 runs the reference oracle");
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn compare(seed: u64, count: usize) {
    let scenarios = python(
        &[
            "gen.py",
            "--seed",
            &seed.to_string(),
            "--count",
            &count.to_string(),
        ],
        None,
    );
    let file = std::env::temp_dir().join(format!(
        "fairplace-diff-{seed}-{}.jsonl",
        std::process::id()
    ));
    std::fs::write(&file, &scenarios).unwrap();
    let oracle = python(&["oracle.py", "-"], Some(&file));
    let mut ours = Vec::new();
    let mut err = Vec::new();
    let bad = fairplace::offline::decide::run(&scenarios, &mut ours, &mut err).unwrap();
    std::fs::remove_file(&file).ok();
    assert_eq!(
        bad,
        0,
        "generated scenarios are valid: {}",
        String::from_utf8_lossy(&err)
    );

    let ours = String::from_utf8(ours).unwrap();
    let lines: Vec<&str> = scenarios.lines().collect();
    let mut disagree = Vec::new();
    let mut seen = 0;
    for (i, (a, b)) in oracle.lines().zip(ours.lines()).enumerate() {
        let a: Value = serde_json::from_str(a).unwrap();
        let b: Value = serde_json::from_str(b).unwrap();
        let keys: &[&str] = if a.get("cpu").is_some() {
            &["cpu", "path", "scanned"]
        } else {
            &["allowed", "new_dst_cpu", "flags", "reason"]
        };
        seen += 1;
        if keys.iter().any(|k| a.get(*k) != b.get(*k)) {
            let name: Value = serde_json::from_str(lines[i]).unwrap();
            disagree.push(format!("{}: oracle {a} engine {b}", name["name"]));
        }
    }
    assert_eq!(seen, count, "one answer per scenario from both");
    assert!(
        disagree.is_empty(),
        "{} of {count} disagree (seed {seed}):\n{}",
        disagree.len(),
        disagree
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn engine_agrees_with_the_reference_oracle_on_random_scenarios() {
    compare(2026, 1500);
}
