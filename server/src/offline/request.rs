//! One scenario of any request kind: the placement and migration requests
//! of the format (`scenario`) and this project's balance request
//! (`balance`). `decide` and the `Decide` RPC answer through here.

use serde_json::Value;

use crate::engine::topology::FieldError;

use super::{balance, scenario};

/// Parses and decides one scenario, returning the output line's object.
pub fn decide_value(v: &Value) -> Result<Value, FieldError> {
    if balance::is_balance(v) {
        balance::decide_balance(v)
    } else {
        scenario::decide_value(v)
    }
}
