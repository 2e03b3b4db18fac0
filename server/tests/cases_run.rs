//! Runs `fairplace-server decide` (the real binary) over the scenario files in
//! tests/cases and requires every compared field of every `expected` answer
//! to match: cpu, path and scanned for placements; allowed, new_dst_cpu,
//! flags and reason for can_migrate; plus any `detail` key the case gives.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const PLACE_KEYS: [&str; 3] = ["cpu", "path", "scanned"];
const MIGRATE_KEYS: [&str; 5] = ["allowed", "new_dst_cpu", "flags", "reason", "task_hot"];

fn run_case_file(name: &str) -> usize {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/cases")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("case file");
    let cases: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("case is JSON"))
        .collect();
    let out = Command::new(env!("CARGO_BIN_EXE_fairplace-server"))
        .arg("decide")
        .arg(&path)
        .output()
        .expect("run decide");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let answers: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("decide prints JSON lines"))
        .collect();
    assert_eq!(answers.len(), cases.len(), "one answer per scenario");
    let mut failures = Vec::new();
    for (case, got) in cases.iter().zip(&answers) {
        let name = case["name"].as_str().unwrap_or("?");
        let exp = &case["expected"];
        if let Some(err) = got.get("error") {
            failures.push(format!("{name}: rejected: {err}"));
            continue;
        }
        let keys: &[&str] = if exp.get("cpu").is_some() {
            &PLACE_KEYS
        } else {
            &MIGRATE_KEYS
        };
        for k in keys {
            match exp.get(*k) {
                Some(e) if got.get(*k) != Some(e) => {
                    failures.push(format!("{name}: {k} expected {e}, got {}", got[*k]));
                }
                Some(_) => {}
                // task_hot is informative in the format; every other compared
                // field must be given, or the case checks less than it seems.
                None if *k != "task_hot" => {
                    failures.push(format!("{name}: expected.{k} is missing"))
                }
                None => {}
            }
        }
        if let Some(Value::Object(d)) = exp.get("detail") {
            for (k, e) in d {
                if got["detail"].get(k) != Some(e) {
                    failures.push(format!(
                        "{name}: detail.{k} expected {e}, got {}",
                        got["detail"][k]
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases disagree:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert!(
        out.status.success(),
        "decide exits 0 when every scenario is valid"
    );
    cases.len()
}

#[test]
fn decide_agrees_with_the_40_shipped_examples() {
    assert_eq!(run_case_file("examples.jsonl"), 40);
}

fn decide_stdin(input: &str) -> (Vec<Value>, String, i32) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairplace-server"))
        .args(["decide", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (
        lines,
        String::from_utf8(out.stderr).unwrap(),
        out.status.code().unwrap(),
    )
}

const ONE: &str = r#"{"topology": {"cpus": [{"id": 0, "core": 0, "llc": 0}, {"id": 1, "core": 1, "llc": 0}]},
 "cpus": [{"id": 0, "nr_running": 1}],
 "task": {"prev_cpu": 0}, "request": {"kind": "wakeup", "this_cpu": 0}, "expected": {"cpu": 1}}"#;

#[test]
fn decide_reads_an_object_an_array_and_json_lines() {
    // prev 0 is busy; CPU 1 is idle: the LLC scan finds it.
    let (lines, _, code) = decide_stdin(ONE);
    assert_eq!(code, 0);
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["cpu"], 1);
    assert_eq!(lines[0]["path"], "idle_cpu");
    assert_eq!(lines[0]["scanned"], 1);

    let (lines, _, code) = decide_stdin(&format!("[{ONE}, {ONE}]"));
    assert_eq!((lines.len(), code), (2, 0));

    let one_line = ONE.replace('\n', " ");
    let (lines, _, code) = decide_stdin(&format!("{one_line}\n\n{one_line}\n"));
    assert_eq!((lines.len(), code), (2, 0));
}

#[test]
fn decide_reports_invalid_scenarios_in_place_and_exits_nonzero() {
    let one_line = ONE.replace('\n', " ");
    let bad = one_line.replace(
        r#""prev_cpu": 0"#,
        r#""prev_cpu": 0, "cpus_allowed": "0-300""#,
    );
    let input = format!("{one_line}\n{bad}\n{{not json\n{one_line}\n");
    let (lines, stderr, code) = decide_stdin(&input);
    assert_eq!(code, 1);
    assert_eq!(lines.len(), 4, "one line per scenario, errors in place");
    assert_eq!(lines[0]["cpu"], 1);
    assert_eq!(
        lines[1]["error"],
        "task.cpus_allowed: CPU 300 is not in the topology"
    );
    assert!(
        lines[2]["error"]
            .as_str()
            .unwrap()
            .starts_with("line 3: malformed JSON")
    );
    assert_eq!(lines[3]["cpu"], 1);
    assert!(stderr.contains("scenario 2: task.cpus_allowed: CPU 300 is not in the topology"));
}

#[test]
fn decide_agrees_with_the_hand_worked_cases() {
    // Each case carries generator.why: the reasoning from the spec.
    assert!(run_case_file("hand.jsonl") >= 60);
}
