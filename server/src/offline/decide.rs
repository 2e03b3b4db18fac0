//! `fairplace-server decide`: scenarios in, one decision per scenario out.
//!
//! The input is read as a stream. Its form is told by its start (after an
//! optional UTF-8 byte order mark and any whitespace):
//!
//! - `[`: a JSON array of scenarios, read whole (at most
//!   [`Limits::max_document_bytes`]) and checked before any answer;
//! - a first line that is a complete JSON value (or not JSON at all): JSON
//!   Lines, one scenario per line, blank lines skipped. Each line is answered
//!   as soon as it is read, so memory stays bounded however long the input;
//!   a line longer than [`Limits::max_line_bytes`] or not valid UTF-8 is an
//!   error for that line only;
//! - a first line that starts a JSON value without ending it: one scenario
//!   over several lines, read whole (at most
//!   [`Limits::max_document_bytes`]). If the whole input is not one value it
//!   is taken as JSON Lines after all, line by line.

use std::io::{self, Read, Write};

use serde::de::{self, DeserializeSeed, IgnoredAny, SeqAccess, Visitor};
use serde_json::{Value, json};

use crate::engine::topology::FieldError;
use crate::offline::request::decide_value;

/// Default for [`Limits::max_line_bytes`]: 16 MiB.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;
/// Default for [`Limits::max_document_bytes`]: 64 MiB.
pub const DEFAULT_MAX_DOCUMENT_BYTES: usize = 64 << 20;

/// Input bounds of [`run_stream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest JSON Lines line (bytes, without its newline); a longer line
    /// is an error for that line, skipped without being held in memory.
    pub max_line_bytes: usize,
    /// Largest JSON array or multi-line object (bytes); a larger one is an
    /// error, reported without reading the rest of the input.
    pub max_document_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            max_document_bytes: DEFAULT_MAX_DOCUMENT_BYTES,
        }
    }
}

impl Limits {
    /// No bounds: for input already in memory.
    pub const UNLIMITED: Limits = Limits {
        max_line_bytes: usize::MAX,
        max_document_bytes: usize::MAX,
    };
}

/// Decides every scenario of `input`, writing one JSON line per scenario to
/// `out` (an `{"error": ...}` line for an invalid one, so lines stay aligned
/// with the input) and each error also to `err`. Returns how many scenarios
/// were invalid.
pub fn run(input: &str, out: &mut impl Write, err: &mut impl Write) -> io::Result<usize> {
    run_stream(input.as_bytes(), out, err, Limits::UNLIMITED)
}

/// [`run`] over a stream: answers JSON Lines line by line (flushing `out`
/// whenever the input has nothing more ready), with memory bounded by
/// `limits`. An oversized array or multi-line object is one invalid
/// scenario. Errors are I/O errors of `input`, `out` or `err`.
pub fn run_stream(
    input: impl Read,
    out: &mut impl Write,
    err: &mut impl Write,
    limits: Limits,
) -> io::Result<usize> {
    let mut r = Input::new(input);
    let mut e = Emitter {
        out,
        err,
        n: 0,
        bad: 0,
    };

    // An optional byte order mark, then whitespace up to the first token
    // (its line number is kept for messages).
    r.skip_bom()?;
    let mut lineno = 1 + r.skip_whitespace(e.out)?;
    let Some(first) = r.peek(e.out)? else {
        e.out.flush()?;
        return Ok(0);
    };
    let mut line = Vec::new();

    if first == b'[' {
        let mut doc = vec![b'\n'; lineno - 1];
        let start = doc.len();
        if !r.read_to_end_limited(
            &mut doc,
            limits.max_document_bytes.saturating_add(start),
            e.out,
        )? {
            e.too_large(limits)?;
        } else {
            e.array(&doc)?;
        }
        e.out.flush()?;
        return Ok(e.bad);
    }

    // The first line tells JSON Lines from one object over several lines; it
    // may be as long as a document.
    let first_max = limits.max_document_bytes.max(limits.max_line_bytes);
    let Some(len) = r.read_line(first_max, &mut line, e.out)? else {
        return Ok(0);
    };
    if len <= first_max && starts_a_value(&line) {
        let mut doc = vec![b'\n'; lineno - 1];
        doc.extend_from_slice(&line);
        doc.push(b'\n');
        let limit = limits.max_document_bytes.saturating_add(lineno - 1);
        if doc.len() > limit.saturating_add(1)
            || !r.read_to_end_limited(&mut doc, limit.saturating_add(1), e.out)?
        {
            e.too_large(limits)?;
        } else {
            e.document(&doc, lineno, limits)?;
        }
        e.out.flush()?;
        return Ok(e.bad);
    }

    // JSON Lines.
    let mut len = Some(len);
    while let Some(n) = len {
        if let Some(item) = line_item(lineno, &line, n, limits) {
            e.emit(item)?;
        }
        lineno += 1;
        len = r.read_line(limits.max_line_bytes, &mut line, e.out)?;
    }
    e.out.flush()?;
    Ok(e.bad)
}

/// True if `line` is the start of a JSON value that does not end on it.
fn starts_a_value(line: &[u8]) -> bool {
    match serde_json::from_slice::<IgnoredAny>(trim_cr(line)) {
        Ok(_) => false,
        Err(e) => e.is_eof(),
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// One JSON Lines line (`len` bytes long, of which `line` holds the start):
/// none if blank.
fn line_item(
    lineno: usize,
    line: &[u8],
    len: usize,
    limits: Limits,
) -> Option<Result<Value, FieldError>> {
    let field = || format!("line {lineno}");
    if len > limits.max_line_bytes {
        return Some(Err(FieldError::new(
            field(),
            format!(
                "longer than --max-line-bytes ({} bytes)",
                limits.max_line_bytes
            ),
        )));
    }
    let text = match std::str::from_utf8(trim_cr(line)) {
        Ok(t) => t,
        Err(e) => return Some(Err(FieldError::new(field(), format!("invalid UTF-8: {e}")))),
    };
    if text.trim().is_empty() {
        return None;
    }
    Some(
        serde_json::from_str::<Value>(text)
            .map_err(|e| FieldError::new(field(), format!("malformed JSON: {e}"))),
    )
}

fn malformed(e: impl std::fmt::Display) -> FieldError {
    FieldError::new("input", format!("malformed JSON: {e}"))
}

/// Writes the answers and counts the scenarios.
struct Emitter<'a, O, E> {
    out: &'a mut O,
    err: &'a mut E,
    /// Scenarios seen.
    n: usize,
    /// Invalid ones.
    bad: usize,
}

impl<O: Write, E: Write> Emitter<'_, O, E> {
    fn emit(&mut self, item: Result<Value, FieldError>) -> io::Result<()> {
        self.n += 1;
        let line = match item.and_then(|v| decide_value(&v)) {
            Ok(v) => v,
            Err(e) => {
                self.bad += 1;
                writeln!(self.err, "scenario {}: {e}", self.n)?;
                json!({ "error": e.to_string() })
            }
        };
        writeln!(self.out, "{}", Value::to_string(&line))
    }

    fn too_large(&mut self, limits: Limits) -> io::Result<()> {
        self.emit(Err(FieldError::new(
            "input",
            format!(
                "a JSON array or multi-line object larger than --max-document-bytes ({} bytes); \
                 give JSON Lines (one scenario per line) to stream any number of scenarios",
                limits.max_document_bytes
            ),
        )))
    }

    /// A whole JSON array: checked first (a malformed array is one error, as
    /// nothing was answered yet), then decided element by element.
    fn array(&mut self, doc: &[u8]) -> io::Result<()> {
        if let Err(e) = std::str::from_utf8(doc) {
            return self.emit(Err(FieldError::new("input", format!("invalid UTF-8: {e}"))));
        }
        if let Err(e) = serde_json::from_slice::<IgnoredAny>(doc) {
            return self.emit(Err(malformed(e)));
        }
        let mut failed = None;
        let mut de = serde_json::Deserializer::from_slice(doc);
        let r = de::Deserializer::deserialize_seq(
            &mut de,
            Each {
                emitter: self,
                failed: &mut failed,
            },
        );
        if let Some(e) = failed {
            return Err(e);
        }
        match r.and_then(|()| de.end()) {
            Ok(()) => Ok(()),
            // Only what the syntax check does not see (a number out of
            // range): the answers so far stand.
            Err(e) => self.emit(Err(malformed(e))),
        }
    }

    /// A whole input that did not start with `[` and whose first line is an
    /// unfinished value: one scenario if it is one value, else JSON Lines.
    fn document(&mut self, doc: &[u8], first_line: usize, limits: Limits) -> io::Result<()> {
        if let Ok(v) = serde_json::from_slice::<Value>(doc) {
            return self.emit(Ok(v));
        }
        // The document starts with a newline for each blank line before it.
        let lines = doc.split(|&b| b == b'\n').enumerate().skip(first_line - 1);
        for (i, line) in lines {
            let lineno = i + 1;
            if let Some(item) = line_item(lineno, line, line.len(), limits) {
                self.emit(item)?;
            }
        }
        Ok(())
    }
}

/// Visits a JSON array, deciding each element as it is parsed.
struct Each<'e, 'a, O, E> {
    emitter: &'e mut Emitter<'a, O, E>,
    failed: &'e mut Option<io::Error>,
}

impl<'de, O: Write, E: Write> Visitor<'de> for Each<'_, '_, O, E> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(v) = seq.next_element_seed(ValueSeed)? {
            if let Err(e) = self.emitter.emit(Ok(v)) {
                *self.failed = Some(e);
                return Err(de::Error::custom("output failed"));
            }
        }
        Ok(())
    }
}

struct ValueSeed;

impl<'de> DeserializeSeed<'de> for ValueSeed {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        serde::Deserialize::deserialize(d)
    }
}

/// A buffered reader that flushes the output before it waits for input, so
/// every answer to the input read so far is out before the next read.
struct Input<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    eof: bool,
}

impl<R: Read> Input<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            buf: vec![0; 64 * 1024].into_boxed_slice(),
            pos: 0,
            end: 0,
            eof: false,
        }
    }

    /// Makes input available; false at the end of the input.
    fn fill(&mut self, out: &mut impl Write) -> io::Result<bool> {
        if self.pos < self.end {
            return Ok(true);
        }
        if self.eof {
            return Ok(false);
        }
        out.flush()?;
        loop {
            match self.inner.read(&mut self.buf) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.pos = 0;
                    self.end = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn peek(&mut self, out: &mut impl Write) -> io::Result<Option<u8>> {
        Ok(self.fill(out)?.then(|| self.buf[self.pos]))
    }

    /// Skips a UTF-8 byte order mark at the start of the input (nothing is
    /// consumed yet, so the buffer holds the input from its first byte).
    fn skip_bom(&mut self) -> io::Result<()> {
        const BOM: &[u8] = b"\xEF\xBB\xBF";
        while self.end < BOM.len() && !self.eof {
            match self.inner.read(&mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.buf[..self.end].starts_with(BOM) {
            self.pos = BOM.len();
        }
        Ok(())
    }

    /// Skips ASCII whitespace; returns how many newlines it skipped.
    fn skip_whitespace(&mut self, out: &mut impl Write) -> io::Result<usize> {
        let mut newlines = 0;
        while self.fill(out)? {
            let avail = &self.buf[self.pos..self.end];
            let n = avail
                .iter()
                .position(|b| !b.is_ascii_whitespace())
                .unwrap_or(avail.len());
            newlines += avail[..n].iter().filter(|&&b| b == b'\n').count();
            self.pos += n;
            if self.pos < self.end {
                break;
            }
        }
        Ok(newlines)
    }

    /// Reads one line into `line` without its newline, keeping at most
    /// `max + 1` bytes of it (the rest is read and dropped). Returns the
    /// line's full length, or none at the end of the input.
    fn read_line(
        &mut self,
        max: usize,
        line: &mut Vec<u8>,
        out: &mut impl Write,
    ) -> io::Result<Option<usize>> {
        line.clear();
        let mut total = 0usize;
        let mut any = false;
        while self.fill(out)? {
            any = true;
            let avail = &self.buf[self.pos..self.end];
            let (chunk, done) = match avail.iter().position(|&b| b == b'\n') {
                Some(i) => (&avail[..i], true),
                None => (avail, false),
            };
            let keep = chunk
                .len()
                .min(max.saturating_add(1).saturating_sub(line.len()));
            line.extend_from_slice(&chunk[..keep]);
            total = total.saturating_add(chunk.len());
            self.pos += chunk.len() + usize::from(done);
            if done {
                return Ok(Some(total));
            }
        }
        Ok(any.then_some(total))
    }

    /// Appends the rest of the input to `doc`; false (and stops reading) once
    /// `doc` would exceed `limit` bytes.
    fn read_to_end_limited(
        &mut self,
        doc: &mut Vec<u8>,
        limit: usize,
        out: &mut impl Write,
    ) -> io::Result<bool> {
        while self.fill(out)? {
            let avail = &self.buf[self.pos..self.end];
            if doc.len().saturating_add(avail.len()) > limit {
                return Ok(false);
            }
            doc.extend_from_slice(avail);
            self.pos = self.end;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader handing out one byte per read.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() || buf.is_empty() {
                return Ok(0);
            }
            buf[0] = self.0[0];
            self.0 = &self.0[1..];
            Ok(1)
        }
    }

    fn lines(input: &[u8], limits: Limits, trickle: bool) -> (Vec<Value>, String, usize) {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let bad = if trickle {
            run_stream(Trickle(input), &mut out, &mut err, limits)
        } else {
            run_stream(input, &mut out, &mut err, limits)
        }
        .unwrap();
        let v = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (v, String::from_utf8(err).unwrap(), bad)
    }

    const ONE: &str = r#"{"topology": {"cpus": [{"id": 0, "core": 0, "llc": 0}, {"id": 1, "core": 1, "llc": 0}]},
 "cpus": [{"id": 0, "nr_running": 1}],
 "task": {"prev_cpu": 0}, "request": {"kind": "wakeup", "this_cpu": 0}}"#;

    #[test]
    fn every_form_gives_the_same_answers_however_the_input_arrives() {
        let one_line = ONE.replace('\n', " ");
        let forms = [
            (ONE.to_string(), 1),
            (format!("\n\n  {ONE}\n\n"), 1),
            (format!("[{ONE},\n{ONE}]"), 2),
            (format!("\n  [{ONE}, {ONE}, {ONE}]\n"), 3),
            (format!("{one_line}\n\n{one_line}\r\n{one_line}"), 3),
            (format!("\u{feff}{one_line}\n{one_line}\n"), 2),
            (format!("\u{feff}{ONE}"), 1),
            (format!("\u{feff}[{ONE}]"), 1),
        ];
        for (input, n) in forms {
            for trickle in [false, true] {
                let (v, err, bad) = lines(input.as_bytes(), Limits::default(), trickle);
                assert_eq!((v.len(), bad), (n, 0), "{input:?}: {err}");
                assert!(v.iter().all(|a| a["cpu"] == 1), "{input:?}");
            }
        }
    }

    #[test]
    fn the_old_whole_input_rules_still_hold() {
        // An empty input and whitespace: no scenario.
        assert_eq!(lines(b"", Limits::default(), false).0.len(), 0);
        assert_eq!(lines(b" \n\n ", Limits::default(), false).0.len(), 0);
        // A malformed array is one error.
        let (v, _, bad) = lines(b"[{\"a\": 1},\n{", Limits::default(), false);
        assert_eq!((v.len(), bad), (1, 1));
        assert!(
            v[0]["error"]
                .as_str()
                .unwrap()
                .starts_with("input: malformed JSON")
        );
        // An unfinished first line that is not one object: line by line,
        // with the lines numbered as in the input.
        let one_line = ONE.replace('\n', " ");
        let input = format!("\n{{\"a\":\n{one_line}\n");
        let (v, _, bad) = lines(input.as_bytes(), Limits::default(), false);
        assert_eq!((v.len(), bad), (2, 1));
        assert!(
            v[0]["error"]
                .as_str()
                .unwrap()
                .starts_with("line 2: malformed JSON")
        );
        assert_eq!(v[1]["cpu"], 1);
    }

    #[test]
    fn limits_apply_per_line_and_per_document() {
        let one_line = ONE.replace('\n', " ");
        let long = format!("{{\"name\": \"{}\"}}", "x".repeat(1000));
        let input = format!("{one_line}\n{long}\n{one_line}\n");
        let limits = Limits {
            max_line_bytes: 500,
            max_document_bytes: 100_000,
        };
        for trickle in [false, true] {
            let (v, err, bad) = lines(input.as_bytes(), limits, trickle);
            assert_eq!((v.len(), bad), (3, 1));
            assert_eq!(
                v[1]["error"],
                "line 2: longer than --max-line-bytes (500 bytes)"
            );
            assert!(err.contains("scenario 2: line 2: longer than"), "{err}");
            assert_eq!((&v[0]["cpu"], &v[2]["cpu"]), (&json!(1), &json!(1)));
        }
        let small = Limits {
            max_line_bytes: 500,
            max_document_bytes: 120,
        };
        for input in [format!("[{ONE}]"), ONE.to_string()] {
            let (v, _, bad) = lines(input.as_bytes(), small, false);
            assert_eq!((v.len(), bad), (1, 1));
            assert!(
                v[0]["error"]
                    .as_str()
                    .unwrap()
                    .contains("larger than --max-document-bytes (120 bytes)")
            );
        }
    }

    #[test]
    fn an_invalid_utf8_line_is_an_error_for_that_line_only() {
        let one_line = ONE.replace('\n', " ");
        let mut input = format!("{one_line}\n").into_bytes();
        input.extend_from_slice(b"{\"name\": \"\xff\xfe\"}\n");
        input.extend_from_slice(format!("{one_line}\n").as_bytes());
        let (v, _, bad) = lines(&input, Limits::default(), false);
        assert_eq!((v.len(), bad), (3, 1));
        assert!(
            v[1]["error"]
                .as_str()
                .unwrap()
                .starts_with("line 2: invalid UTF-8")
        );
        assert_eq!((&v[0]["cpu"], &v[2]["cpu"]), (&json!(1), &json!(1)));
    }
}
