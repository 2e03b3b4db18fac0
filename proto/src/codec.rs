//! The protobuf codec with small initial buffers.
//!
//! Every open stream keeps an encode and a decode buffer; tonic's default
//! starts each at 8 KiB. An agent stream carries a few-KiB snapshot and tiny
//! acks, and a server holds one such stream per node, so with 10,000 nodes
//! the defaults alone would cost ~160 MiB. The buffers still grow as a
//! message needs.
//!
//! A message that does not decode is the caller's fault: it is answered
//! INVALID_ARGUMENT (tonic's prost codec says INTERNAL, a server error).

use std::marker::PhantomData;

use prost::bytes::{BufMut, Bytes, BytesMut};

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::ProstEncoder;

const BUFFER: usize = 1024;
const YIELD_THRESHOLD: usize = 32 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = LeanDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        LeanDecoder(PhantomData)
    }
}

/// Decodes `U`; an undecodable message is INVALID_ARGUMENT.
#[derive(Debug, Clone, Copy)]
pub struct LeanDecoder<U>(PhantomData<U>);

impl<U: prost::Message + Default> Decoder for LeanDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(BUFFER, YIELD_THRESHOLD)
    }
}

/// The bytes of gRPC's length prefix: a compressed flag and a big-endian
/// length.
pub const PREFIX: usize = 5;

/// One message in gRPC's framing (uncompressed), in a buffer of exactly
/// its size.
pub fn frame(msg: &impl prost::Message) -> Bytes {
    let len = msg.encoded_len();
    let mut b = BytesMut::with_capacity(PREFIX + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    // `encode` would measure the message a second time to check the room
    // reserved just above; a PickCpu answer's ten fields are measured once.
    msg.encode_raw(&mut b);
    debug_assert_eq!(b.len(), PREFIX + len);
    b.freeze()
}
