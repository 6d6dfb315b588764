//! The protobuf codec of the `fence.v1` stubs: prost's, except that a request body that does
//! not decode is the caller's fault, answered INVALID_ARGUMENT (prost's codec answers INTERNAL,
//! which clients read as a server fault and retry). A response that does not decode, on the
//! client side, stays INTERNAL.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// The codec the generated `fence.v1` client and server use.
#[derive(Debug, Clone)]
pub struct FenceCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for FenceCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for FenceCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = FenceDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        FenceDecoder {
            inner: ProstCodec::<T, U>::raw_decoder(BufferSettings::default()),
        }
    }
}

/// Decodes `U`, blaming the caller for a request that does not decode.
#[derive(Debug)]
pub struct FenceDecoder<U> {
    inner: ProstDecoder<U>,
}

/// The message name of `U` (`BeginRequest`), from its Rust path.
fn message_name<U>() -> &'static str {
    let path = std::any::type_name::<U>();
    path.rsplit("::").next().unwrap_or(path)
}

impl<U: Message + Default> Decoder for FenceDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            let name = message_name::<U>();
            // Every fence.v1 request message is named `...Request`; the server decodes only
            // those, the client only responses.
            if name.ends_with("Request") {
                Status::invalid_argument(format!(
                    "the request body is not a valid fence.v1.{name} message: {}",
                    status.message()
                ))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}
