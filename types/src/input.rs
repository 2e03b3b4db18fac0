//! The framing of scenario input, shared by `fairplace-server decide` and
//! the CLI's `decide` (which sends each scenario to a server).

use serde_json::Value;

use crate::FieldError;

/// Splits `decide`'s input into scenarios: one JSON object, a JSON array of
/// them, or JSON Lines. Each item is the scenario or the error that made it
/// unreadable.
pub fn split_input(text: &str) -> Vec<Result<Value, FieldError>> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('[') {
        return match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(items)) => items.into_iter().map(Ok).collect(),
            Ok(_) => vec![Err(FieldError::new("input", "expected a JSON array"))],
            Err(e) => vec![Err(FieldError::new(
                "input",
                format!("malformed JSON: {e}"),
            ))],
        };
    }
    // One object (possibly pretty-printed over many lines), or JSON Lines.
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        return vec![Ok(v)];
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str::<Value>(l).map_err(|e| {
                FieldError::new(format!("line {}", i + 1), format!("malformed JSON: {e}"))
            })
        })
        .collect()
}
