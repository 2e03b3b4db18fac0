//! `fairplace-server decide`: scenarios in, one decision per scenario out.

use std::io::Write;

use serde_json::{Value, json};

use crate::scenario::{decide_value, split_input};

/// Decides every scenario of `input`, writing one JSON line per scenario to
/// `out` (an `{"error": ...}` line for an invalid one, so lines stay aligned
/// with the input) and each error also to `err`. Returns how many scenarios
/// were invalid.
pub fn run(input: &str, out: &mut impl Write, err: &mut impl Write) -> std::io::Result<usize> {
    let mut bad = 0;
    for (i, item) in split_input(input).into_iter().enumerate() {
        let line = match item.and_then(|v| decide_value(&v)) {
            Ok(v) => v,
            Err(e) => {
                bad += 1;
                writeln!(err, "scenario {}: {e}", i + 1)?;
                json!({ "error": e.to_string() })
            }
        };
        writeln!(out, "{}", Value::to_string(&line))?;
    }
    Ok(bad)
}
