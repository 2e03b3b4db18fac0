//! `fairplace-server decide` reads its input as a stream: JSON Lines are
//! answered line by line with bounded memory (the input may be endless), a
//! bad line is an error for that line only, and an array or a multi-line
//! object is bounded by --max-document-bytes.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A valid wakeup whose answer is CPU 1 (prev 0 is busy, CPU 1 idle).
const ONE: &str = r#"{"topology": {"cpus": [{"id": 0, "core": 0, "llc": 0}, {"id": 1, "core": 1, "llc": 0}]}, "cpus": [{"id": 0, "nr_running": 1}], "task": {"prev_cpu": 0}, "request": {"kind": "wakeup", "this_cpu": 0}}"#;

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_fairplace-server"))
        .arg("decide")
        .args(args)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run decide")
}

/// Runs decide over `input` (written from a thread, so a large input cannot
/// dead-lock against the answers); returns the answers, stderr and the exit
/// code.
fn decide(args: &[&str], input: Vec<u8>) -> (Vec<Value>, String, i32) {
    let mut child = spawn(args);
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        // The process may stop reading early (an oversized document).
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("decide prints JSON lines"))
        .collect();
    (
        lines,
        String::from_utf8(out.stderr).unwrap(),
        out.status.code().unwrap(),
    )
}

/// Waits for `child` at most `limit`.
fn wait_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// The process's peak resident set (VmHWM) in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn json_lines_are_answered_one_by_one_before_the_input_ends() {
    let mut child = spawn(&[]);
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    // Answers are read on a thread so a missing one fails the test instead
    // of hanging it.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    for i in 0..20 {
        // Each line goes alone, with pauses: the input never ends while the
        // answers are read.
        stdin.write_all(ONE.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
        let answer = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no answer to line {} while the input is open", i + 1));
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["cpu"], 1, "{answer}");
        if i % 5 == 0 {
            std::thread::sleep(Duration::from_millis(50));
            // Nothing more than one answer per line.
            assert!(rx.try_recv().is_err());
        }
    }
    drop(stdin);
    let status = wait_within(&mut child, Duration::from_secs(20)).expect("decide exits");
    assert!(status.success());
    assert!(
        rx.recv_timeout(Duration::from_secs(5)).is_err(),
        "no extra answer"
    );
}

/// What the answer reader saw: answers naming CPU 1, and the others with
/// their line index.
type Answers = (usize, Vec<(usize, Value)>);

/// Reads every answer on a thread, counting those that name CPU 1 and
/// keeping the others; sends the count of answers read after each one.
fn read_answers(stdout: ChildStdout, tx: mpsc::Sender<usize>) -> JoinHandle<Answers> {
    std::thread::spawn(move || {
        let mut ok = 0usize;
        let mut errors = Vec::new();
        for (i, l) in BufReader::new(stdout).lines().enumerate() {
            let v: Value = serde_json::from_str(&l.unwrap()).unwrap();
            if v["cpu"] == 1 {
                ok += 1;
            } else {
                errors.push((i, v));
            }
            let _ = tx.send(i + 1);
        }
        (ok, errors)
    })
}

/// Reads all of stderr on a thread.
fn read_stderr(stderr: ChildStderr) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        BufReader::new(stderr).read_to_string(&mut s).unwrap();
        s
    })
}

/// Writes `lines` copies of `line`, and before copy `long_at` a line of
/// 40 MiB, generated on the fly: the input is never whole anywhere.
fn write_stream(stdin: &mut ChildStdin, line: &str, lines: usize, long_at: usize) {
    for i in 0..lines {
        if i == long_at {
            // Over the default 16 MiB line limit: an error for this line,
            // skipped without being held.
            let chunk = vec![b'x'; 1 << 20];
            stdin.write_all(br#"{"name": ""#).unwrap();
            for _ in 0..40 {
                stdin.write_all(&chunk).unwrap();
            }
            stdin.write_all(b"\"}\n").unwrap();
        }
        stdin.write_all(line.as_bytes()).unwrap();
    }
    stdin.flush().unwrap();
}

/// Waits until the reader has seen `expected` answers, each within 2
/// minutes of the last and all within 10.
fn wait_for_answers(rx: &mpsc::Receiver<usize>, expected: usize) {
    let t0 = Instant::now();
    let mut seen = 0;
    while seen < expected {
        seen = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("answers keep coming");
        assert!(t0.elapsed() < Duration::from_secs(600), "too slow");
    }
}

#[test]
fn a_200_mb_stream_with_a_40_mb_line_runs_in_bounded_memory() {
    const TOTAL: usize = 200 << 20;
    const LONG_AT: usize = 1000;
    // Long lines (a free-text name) keep the scenario count, and so the
    // test's time, modest; what is measured is the bytes.
    let line = ONE.replacen("{", &format!(r#"{{"name": "{}", "#, "x".repeat(2000)), 1) + "\n";
    let lines = TOTAL / line.len();
    let mut child = spawn(&[]);
    let pid = child.id();
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = read_answers(child.stdout.take().unwrap(), tx);
    let err_reader = read_stderr(child.stderr.take().unwrap());
    write_stream(&mut stdin, &line, lines, LONG_AT);
    // Every answer is in while the input is still open: the process is
    // alive, and its peak memory covers the whole run.
    let expected = lines + 1;
    wait_for_answers(&rx, expected);
    let peak = peak_rss_kib(pid);
    drop(stdin);
    let status = wait_within(&mut child, Duration::from_secs(60)).expect("decide exits");
    let (ok, errors) = reader.join().unwrap();
    let err = err_reader.join().unwrap();
    eprintln!(
        "{} MiB in {} lines: peak RSS {} KiB",
        TOTAL >> 20,
        expected,
        peak
    );
    assert_eq!(ok, lines);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].0, LONG_AT);
    assert_eq!(
        errors[0].1["error"],
        format!(
            "line {}: longer than --max-line-bytes (16777216 bytes)",
            LONG_AT + 1
        )
    );
    assert!(err.contains(&format!("scenario {}: line {}", LONG_AT + 1, LONG_AT + 1)));
    assert_eq!(status.code(), Some(1), "one invalid line: exit 1");
    // The old whole-input reader peaked at gigabytes for this input.
    assert!(peak < 100 * 1024, "peak RSS {peak} KiB");
}

#[test]
fn an_invalid_utf8_line_is_an_error_for_that_line_only() {
    let mut input = format!("{ONE}\n").into_bytes();
    input.extend_from_slice(b"{\"name\": \"caf\xe9\"}\n");
    input.extend_from_slice(format!("{ONE}\n").as_bytes());
    let (lines, stderr, code) = decide(&[], input);
    assert_eq!(code, 1);
    assert_eq!(lines.len(), 3, "one answer per line, the error in place");
    assert_eq!(lines[0]["cpu"], 1);
    assert!(
        lines[1]["error"]
            .as_str()
            .unwrap()
            .starts_with("line 2: invalid UTF-8"),
        "{}",
        lines[1]
    );
    assert_eq!(lines[2]["cpu"], 1);
    assert!(
        stderr.contains("scenario 2: line 2: invalid UTF-8"),
        "{stderr}"
    );
}

#[test]
fn a_utf8_byte_order_mark_is_accepted_in_every_form() {
    let pretty = ONE.replace(", \"", ",\n \"");
    for (input, n) in [
        (format!("\u{feff}{ONE}\n{ONE}\n"), 2),
        (format!("\u{feff}{pretty}"), 1),
        (format!("\u{feff}[{ONE},\n{ONE}]"), 2),
    ] {
        let (lines, stderr, code) = decide(&[], input.into_bytes());
        assert_eq!((code, lines.len()), (0, n), "{stderr}");
        assert!(lines.iter().all(|l| l["cpu"] == 1));
    }
}

#[test]
fn an_over_long_line_is_an_error_for_that_line_only() {
    let long = format!(r#"{{"name": "{}"}}"#, "y".repeat(5000));
    let input = format!("{ONE}\n\n{long}\n{ONE}\n");
    let (lines, stderr, code) = decide(&["--max-line-bytes", "1000"], input.into_bytes());
    assert_eq!(code, 1);
    assert_eq!(lines.len(), 3);
    assert_eq!(
        lines[1]["error"],
        "line 3: longer than --max-line-bytes (1000 bytes)"
    );
    assert_eq!(
        (&lines[0]["cpu"], &lines[2]["cpu"]),
        (&Value::from(1), &Value::from(1))
    );
    assert!(
        stderr.contains("scenario 2: line 3: longer than"),
        "{stderr}"
    );
}

#[test]
fn an_oversized_array_or_object_is_an_error() {
    let array = format!("[{}]", vec![ONE; 20].join(",\n"));
    let pretty = ONE.replace(", \"", ",\n \"");
    for input in [array.clone(), pretty] {
        let (lines, stderr, code) = decide(&["--max-document-bytes", "100"], input.into_bytes());
        assert_eq!((code, lines.len()), (1, 1), "{stderr}");
        let e = lines[0]["error"].as_str().unwrap();
        assert!(
            e.starts_with("input: ") && e.contains("larger than --max-document-bytes (100 bytes)"),
            "{e}"
        );
        assert!(stderr.contains("scenario 1: input: "), "{stderr}");
    }
    // Within the limit the same array is answered.
    let (lines, _, code) = decide(&["--max-document-bytes", "100000"], array.into_bytes());
    assert_eq!((code, lines.len()), (0, 20));
}

#[test]
fn an_endless_array_is_refused_without_reading_it_all() {
    let mut child = spawn(&["--max-document-bytes", "1000000"]);
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let item = format!("{ONE},\n");
        let mut sent = 1usize;
        if stdin.write_all(b"[").is_err() {
            return sent;
        }
        // Until decide hangs up (or far past any sane limit).
        while sent < 1 << 30 {
            if stdin.write_all(item.as_bytes()).is_err() {
                break;
            }
            sent += item.len();
        }
        sent
    });
    let status = wait_within(&mut child, Duration::from_secs(60)).expect("decide gives up");
    assert_eq!(status.code(), Some(1));
    let sent = writer.join().unwrap();
    assert!(sent < 64 << 20, "decide read {sent} bytes");
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("larger than --max-document-bytes (1000000 bytes)")
    );
}
