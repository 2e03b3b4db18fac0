//! fairplace client library.
