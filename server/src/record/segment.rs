//! The bytes of a recording: segment files of checksummed blocks, each a
//! run of length-delimited [`pb::RecordEntry`] messages.
//!
//! A segment is the 8-byte magic, the format version (u32, little-endian),
//! then blocks. A block is its stored length, its decoded length and the
//! CRC-32 of the stored bytes (three u32, little-endian), a codec byte (0
//! stored, 1 an LZ4 block), then the stored bytes. The CRC finds a damaged
//! block; the lengths are bounded, so a damaged length cannot make a reader
//! allocate without limit. LZ4 is used only where it pays (a block that
//! compresses to more than 7/8 of its size is stored as it is).

use std::io::Read;
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;
use prost::Message;

/// The first bytes of every segment.
pub const MAGIC: &[u8; 8] = b"FPREC\r\n\x1a";
/// The version of the format this build writes and reads.
pub const FORMAT: u32 = 1;
/// Segment files are named `NNNNNNNN` followed by this.
pub const SUFFIX: &str = ".fprec";
/// The largest block either side accepts, decoded or stored.
pub const MAX_BLOCK: usize = 16 << 20;
/// A block is closed once this many entry bytes are in it.
pub const BLOCK_TARGET: usize = 64 << 10;

const HEADER: usize = MAGIC.len() + 4;
const BLOCK_HEAD: usize = 13;
const STORED: u8 = 0;
const LZ4: u8 = 1;

/// A segment's header.
pub fn header() -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..].copy_from_slice(&FORMAT.to_le_bytes());
    h
}

/// One block of `raw` (length-delimited entries), compressed where it
/// pays.
pub fn block(raw: &[u8]) -> Vec<u8> {
    let packed = lz4_flex::block::compress(raw);
    let (codec, stored) = if packed.len() < raw.len() / 8 * 7 {
        (LZ4, packed)
    } else {
        (STORED, raw.to_vec())
    };
    let mut out = Vec::with_capacity(BLOCK_HEAD + stored.len());
    out.extend_from_slice(&(stored.len() as u32).to_le_bytes());
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&stored).to_le_bytes());
    out.push(codec);
    out.extend_from_slice(&stored);
    out
}

/// Appends `e` to a block being built, length-delimited.
pub fn push_entry(raw: &mut Vec<u8>, e: &pb::RecordEntry) {
    // Encoding into a Vec cannot fail: it grows as needed.
    let _ = e.encode_length_delimited(raw);
}

/// Where a recording could not be read: the segment, the byte offset of
/// the block (or header) that failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub segment: String,
    pub offset: u64,
    pub what: String,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at offset {}: {}",
            self.segment, self.offset, self.what
        )
    }
}

/// The segment files of `dir`, oldest first (by name: the writer numbers
/// them in order).
pub fn segments(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(SUFFIX))
        })
        .collect();
    v.sort();
    Ok(v)
}

/// Reads one segment's entries in order: every entry up to the first
/// damage, then the damage (a segment is not read past it: nothing after a
/// damaged length can be trusted to be a block boundary).
pub struct SegmentReader<R> {
    input: R,
    name: String,
    offset: u64,
    entries: std::vec::IntoIter<pb::RecordEntry>,
    done: bool,
}

impl SegmentReader<std::io::BufReader<std::fs::File>> {
    pub fn open(path: &Path) -> Result<Self, Damage> {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let f = std::fs::File::open(path).map_err(|e| Damage {
            segment: name.clone(),
            offset: 0,
            what: format!("cannot open: {e}"),
        })?;
        SegmentReader::new(std::io::BufReader::new(f), name)
    }
}

impl<R: Read> SegmentReader<R> {
    /// Checks the header of `input`, a segment called `name`.
    pub fn new(mut input: R, name: String) -> Result<Self, Damage> {
        let mut h = [0u8; HEADER];
        let damage = |what: String| Damage {
            segment: name.clone(),
            offset: 0,
            what,
        };
        let got = read_full(&mut input, &mut h).map_err(|e| damage(e.to_string()))?;
        if got < HEADER {
            return Err(damage(format!(
                "truncated header ({got} of {HEADER} bytes)"
            )));
        }
        if &h[..8] != MAGIC {
            return Err(damage("not a fairplace recording (bad magic)".into()));
        }
        let format = u32::from_le_bytes(h[8..].try_into().expect("4 bytes"));
        if format != FORMAT {
            return Err(damage(format!(
                "format {format}; this build reads format {FORMAT}"
            )));
        }
        Ok(Self {
            input,
            name,
            offset: HEADER as u64,
            entries: Vec::new().into_iter(),
            done: false,
        })
    }

    /// The next block's entries; `Ok(None)` at a clean end.
    fn next_block(&mut self) -> Result<Option<Vec<pb::RecordEntry>>, Damage> {
        let at = self.offset;
        let damage = |what: String| Damage {
            segment: self.name.clone(),
            offset: at,
            what,
        };
        let mut head = [0u8; BLOCK_HEAD];
        let got = read_full(&mut self.input, &mut head).map_err(|e| damage(e.to_string()))?;
        if got == 0 {
            return Ok(None);
        }
        if got < BLOCK_HEAD {
            return Err(damage(format!(
                "truncated block header ({got} of {BLOCK_HEAD} bytes)"
            )));
        }
        let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
        let (stored_len, raw_len, crc, codec) =
            (word(0) as usize, word(4) as usize, word(8), head[12]);
        if stored_len > MAX_BLOCK || raw_len > MAX_BLOCK {
            return Err(damage(format!(
                "block length {stored_len}/{raw_len} is over {MAX_BLOCK} bytes"
            )));
        }
        let mut stored = vec![0u8; stored_len];
        let got = read_full(&mut self.input, &mut stored).map_err(|e| damage(e.to_string()))?;
        if got < stored_len {
            return Err(damage(format!(
                "truncated block ({got} of {stored_len} bytes)"
            )));
        }
        if crc32fast::hash(&stored) != crc {
            return Err(damage("block checksum mismatch".into()));
        }
        let raw = match codec {
            STORED => stored,
            // Decompressing into `raw_len` bytes, no more: a damaged block
            // cannot make it allocate beyond the checked bound.
            LZ4 => lz4_flex::block::decompress(&stored, raw_len)
                .map_err(|e| damage(format!("block does not decompress: {e}")))?,
            c => return Err(damage(format!("unknown codec {c}"))),
        };
        if raw.len() != raw_len {
            return Err(damage(format!(
                "block decompresses to {} bytes, its header says {raw_len}",
                raw.len()
            )));
        }
        let mut entries = Vec::new();
        let mut buf = &raw[..];
        while !buf.is_empty() {
            let e = pb::RecordEntry::decode_length_delimited(&mut buf)
                .map_err(|e| damage(format!("entry {} does not decode: {e}", entries.len())))?;
            entries.push(e);
        }
        self.offset += (BLOCK_HEAD + stored_len) as u64;
        Ok(Some(entries))
    }
}

impl<R: Read> Iterator for SegmentReader<R> {
    type Item = Result<pb::RecordEntry, Damage>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(e) = self.entries.next() {
                return Some(Ok(e));
            }
            if self.done {
                return None;
            }
            match self.next_block() {
                Ok(Some(v)) => self.entries = v.into_iter(),
                Ok(None) => {
                    self.done = true;
                    return None;
                }
                Err(d) => {
                    self.done = true;
                    return Some(Err(d));
                }
            }
        }
    }
}

/// Reads until `buf` is full or the input ends; the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(v: u64) -> pb::RecordEntry {
        pb::RecordEntry {
            entry: Some(pb::record_entry::Entry::State(pb::RecordState {
                node_id: "n".into(),
                version: v,
                ..Default::default()
            })),
        }
    }

    fn segment(blocks: &[&[u64]]) -> Vec<u8> {
        let mut out = header().to_vec();
        for b in blocks {
            let mut raw = Vec::new();
            for &v in *b {
                push_entry(&mut raw, &entry(v));
            }
            out.extend(block(&raw));
        }
        out
    }

    fn read(bytes: &[u8]) -> (Vec<u64>, Option<Damage>) {
        let mut versions = Vec::new();
        let r = match SegmentReader::new(bytes, "s".into()) {
            Ok(r) => r,
            Err(d) => return (versions, Some(d)),
        };
        for e in r {
            match e {
                Ok(pb::RecordEntry {
                    entry: Some(pb::record_entry::Entry::State(s)),
                }) => versions.push(s.version),
                Ok(_) => panic!("unexpected entry"),
                Err(d) => return (versions, Some(d)),
            }
        }
        (versions, None)
    }

    #[test]
    fn blocks_read_back_in_order_compressed_or_not() {
        let many: Vec<u64> = (0..500).collect();
        let bytes = segment(&[&[1, 2], &many]);
        let (v, d) = read(&bytes);
        assert_eq!(d, None);
        assert_eq!(v.len(), 502);
        assert_eq!(&v[..3], &[1, 2, 0]);
        // The repetitive block is compressed.
        let first = u32::from_le_bytes(bytes[HEADER..HEADER + 4].try_into().unwrap()) as usize;
        assert_eq!(bytes[HEADER + BLOCK_HEAD + first + 12], LZ4);
    }

    #[test]
    fn a_block_compression_cannot_shrink_is_stored() {
        // Bytes with no repetition: a linear congruential sequence.
        let mut x: u32 = 12345;
        let noise: String = (0..200)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                char::from(b'!' + ((x >> 16) % 90) as u8)
            })
            .collect();
        let mut raw = Vec::new();
        push_entry(
            &mut raw,
            &pb::RecordEntry {
                entry: Some(pb::record_entry::Entry::Node(pb::RecordNode {
                    node_id: noise,
                    topology: None,
                })),
            },
        );
        let b = block(&raw);
        assert_eq!(b[12], STORED);
        assert_eq!(&b[BLOCK_HEAD..], &raw[..]);
    }

    #[test]
    fn a_flipped_byte_is_found_at_its_block() {
        let mut bytes = segment(&[&[1, 2], &[3, 4]]);
        let second = HEADER
            + BLOCK_HEAD
            + u32::from_le_bytes(bytes[HEADER..HEADER + 4].try_into().unwrap()) as usize;
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        let (v, d) = read(&bytes);
        assert_eq!(v, vec![1, 2]);
        let d = d.expect("damage");
        assert_eq!(d.offset, second as u64);
        assert!(d.what.contains("checksum"), "{d}");
    }

    #[test]
    fn a_truncated_tail_is_reported_with_what_is_missing() {
        let bytes = segment(&[&[1], &[2]]);
        let (v, d) = read(&bytes[..bytes.len() - 3]);
        assert_eq!(v, vec![1]);
        assert!(d.expect("damage").what.starts_with("truncated block"));
    }

    #[test]
    fn a_huge_length_is_refused_without_allocating_it() {
        let mut bytes = segment(&[&[1]]);
        bytes[HEADER..HEADER + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let (_, d) = read(&bytes);
        assert!(d.expect("damage").what.contains("over"));
    }

    #[test]
    fn another_file_or_format_is_refused_at_offset_zero() {
        let (_, d) = read(b"hello world, not a recording");
        assert_eq!(d.clone().unwrap().offset, 0);
        assert!(d.unwrap().what.contains("magic"));
        let mut bytes = segment(&[]);
        bytes[8] = 9;
        assert!(read(&bytes).1.unwrap().what.contains("format 9"));
    }
}
