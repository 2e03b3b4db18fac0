//! Client strings in error messages: quoted, and cut to a short prefix, so
//! a huge value (a 1 MB node id, a 4 MB flag name) is never echoed back or
//! logged whole. Every error that names a client's string goes through
//! here.

use std::borrow::Cow;

/// How much of a client's string an error message quotes.
pub const QUOTE_BYTES: usize = 64;

/// A client-supplied string for an error message: quoted, and cut to
/// [`QUOTE_BYTES`] (on a character boundary) with its full length, so a
/// huge value is never echoed back.
pub fn quote(v: &str) -> String {
    if v.len() <= QUOTE_BYTES {
        return format!("{v:?}");
    }
    let mut end = QUOTE_BYTES;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &v[..end], v.len())
}

/// A client-supplied map key for a field path (`set.KEY`, `selector.KEY`):
/// as it is when short and printable, else [`quote`]d and cut.
pub fn field_key(k: &str) -> Cow<'_, str> {
    if k.len() <= QUOTE_BYTES && !k.chars().any(char::is_control) {
        k.into()
    } else {
        quote(k).into()
    }
}

/// A string as a terminal may show it: every control character (a
/// newline that would forge a row, an escape sequence that would reach the
/// terminal) written as its Rust escape (`\n`, `\u{1b}`), the rest as is.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().collect::<String>()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_for_a_terminal() {
        assert_eq!(printable("rack-1"), "rack-1");
        assert_eq!(printable("a\nb"), "a\\nb");
        assert_eq!(printable("\u{1b}[31mred"), "\\u{1b}[31mred");
        assert!(!printable("x\r\ty\u{7}").chars().any(char::is_control));
    }

    #[test]
    fn short_values_are_quoted_whole() {
        assert_eq!(quote("n1"), "\"n1\"");
        assert_eq!(quote("a\"b\n"), "\"a\\\"b\\n\"");
        assert_eq!(field_key("gpu"), "gpu");
        assert_eq!(field_key("a\nb"), "\"a\\nb\"");
    }

    #[test]
    fn long_values_are_cut_on_a_character_boundary_with_their_length() {
        let long = "x".repeat(1 << 20);
        let q = quote(&long);
        assert_eq!(q, format!("\"{}\"... (1048576 bytes)", "x".repeat(64)));
        // 63 ASCII bytes, then a 3-byte character across the 64-byte cut.
        let s = format!("{}€{}", "a".repeat(63), "b".repeat(100));
        let q = quote(&s);
        assert!(q.starts_with(&format!("\"{}\"...", "a".repeat(63))), "{q}");
        assert!(q.ends_with("(166 bytes)"), "{q}");
        assert!(field_key(&long).len() < 100);
    }
}
