//! What the fairplace server and its clients (the CLI, the agent, the
//! benchmarks) share, kept small so a client does not link the server:
//! CPU masks ([`cpumask`]), which replica owns a node ([`hrw`], the
//! rendezvous hash routing clients compute too), the bounds an agent's report must keep
//! ([`limits`], so the agent trims to exactly what the server accepts),
//! the field-named error every input check returns ([`FieldError`]),
//! how a scenario file is cut into scenarios ([`input`]), and how a
//! client's string is quoted in an error ([`quote`]), and where state that
//! must survive a restart lives by default ([`state_dir`]).

pub mod cpumask;
pub mod hrw;
pub mod input;
pub mod limits;
pub mod quote;
pub mod spiffe;
pub mod state_dir;

use std::fmt;

/// An input that breaks a rule: the offending field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub msg: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            msg: msg.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.msg)
    }
}

impl std::error::Error for FieldError {}
