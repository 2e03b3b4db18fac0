//! Reading the format's JSON objects: [`Obj`] rejects unknown keys up
//! front and reads each field at its type and range, every error naming
//! the field's path; the same rules for the values outside an object.

use serde_json::{Map, Value};

use crate::engine::cpumask::CpuMask;
use crate::engine::topology::FieldError;
use crate::quote::{field_key, quote};

/// A JSON object being read, with its path for error messages. Unknown keys
/// are rejected up front.
pub(in crate::offline) struct Obj<'a> {
    pub(in crate::offline) path: String,
    pub(in crate::offline) map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    pub(in crate::offline) fn new(
        v: &'a Value,
        path: &str,
        known: &[&str],
    ) -> Result<Self, FieldError> {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new(path, "must be an object"))?;
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                return Err(FieldError::new(join(path, k), "unknown field"));
            }
        }
        Ok(Obj {
            path: path.to_string(),
            map,
        })
    }

    pub(in crate::offline) fn field(&self, k: &str) -> String {
        join(&self.path, k)
    }

    /// The value, treating JSON null as absent.
    pub(in crate::offline) fn get(&self, k: &str) -> Option<&'a Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    pub(in crate::offline) fn int(
        &self,
        k: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<i64>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(v) => int_value(v, &self.field(k), min, max).map(Some),
        }
    }

    pub(in crate::offline) fn int_or(
        &self,
        k: &str,
        min: i64,
        max: i64,
        def: i64,
    ) -> Result<i64, FieldError> {
        Ok(self.int(k, min, max)?.unwrap_or(def))
    }

    pub(in crate::offline) fn req_int(
        &self,
        k: &str,
        min: i64,
        max: i64,
    ) -> Result<i64, FieldError> {
        self.int(k, min, max)?
            .ok_or_else(|| FieldError::new(self.field(k), "is required"))
    }

    /// An integer that may be JSON null (`Some(None)`).
    pub(in crate::offline) fn nullable_int(
        &self,
        k: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<Option<i64>>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(None)),
            Some(v) => int_value(v, &self.field(k), min, max).map(|x| Some(Some(x))),
        }
    }

    pub(in crate::offline) fn bool(&self, k: &str) -> Result<Option<bool>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(FieldError::new(self.field(k), "must be true or false")),
        }
    }

    pub(in crate::offline) fn bool_or(&self, k: &str, def: bool) -> Result<bool, FieldError> {
        Ok(self.bool(k)?.unwrap_or(def))
    }

    pub(in crate::offline) fn nullable_bool(&self, k: &str) -> Result<Option<bool>, FieldError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(FieldError::new(
                self.field(k),
                "must be true, false or null",
            )),
        }
    }

    pub(in crate::offline) fn str(&self, k: &str) -> Result<Option<&'a str>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(FieldError::new(self.field(k), "must be a string")),
        }
    }

    pub(in crate::offline) fn choice<T: Copy>(
        &self,
        k: &str,
        opts: &[(&str, T)],
        def: T,
    ) -> Result<T, FieldError> {
        match self.str(k)? {
            None => Ok(def),
            Some(s) => opts
                .iter()
                .find(|(n, _)| *n == s)
                .map(|(_, t)| *t)
                .ok_or_else(|| {
                    let names: Vec<&str> = opts.iter().map(|(n, _)| *n).collect();
                    FieldError::new(
                        self.field(k),
                        format!("{} is not one of {}", quote(s), names.join(", ")),
                    )
                }),
        }
    }

    pub(in crate::offline) fn cpulist(
        &self,
        k: &str,
        n: usize,
    ) -> Result<Option<CpuMask>, FieldError> {
        match self.str(k)? {
            None => Ok(None),
            Some(s) => CpuMask::parse_cpulist(s, n)
                .map(Some)
                .map_err(|e| FieldError::new(self.field(k), e)),
        }
    }

    pub(in crate::offline) fn cpu(&self, k: &str, n: usize) -> Result<Option<usize>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(v) => cpu_value(v, &self.field(k), n).map(Some),
        }
    }
}

/// `path.k`, or `k` at the top level (a long or unprintable `k` quoted).
fn join(path: &str, k: &str) -> String {
    if path.is_empty() {
        field_key(k).into_owned()
    } else {
        format!("{path}.{}", field_key(k))
    }
}

/// `v` as an integer in `min..=max`.
pub(super) fn int_value(v: &Value, field: &str, min: i64, max: i64) -> Result<i64, FieldError> {
    let x = match v {
        Value::Number(n) => n.as_i64().ok_or_else(|| {
            if n.is_u64() {
                FieldError::new(field, format!("{n} is out of range {min}..{max}"))
            } else {
                FieldError::new(field, format!("{n} is not an integer"))
            }
        })?,
        _ => return Err(FieldError::new(field, "must be an integer")),
    };
    if x < min || x > max {
        return Err(FieldError::new(
            field,
            format!("{x} is out of range {min}..{max}"),
        ));
    }
    Ok(x)
}

/// `v` as the id of one of the topology's `n` CPUs.
pub(super) fn cpu_value(v: &Value, field: &str, n: usize) -> Result<usize, FieldError> {
    let x = match v {
        Value::Number(num) => num
            .as_i64()
            .ok_or_else(|| FieldError::new(field, format!("{num} is not a CPU id")))?,
        _ => return Err(FieldError::new(field, "must be a CPU id (integer)")),
    };
    if x < 0 || x as usize >= n {
        return Err(FieldError::new(
            field,
            format!("CPU {x} is not in the topology"),
        ));
    }
    Ok(x as usize)
}
