//! The protobuf codec of `tandem.v1`: prost's, except that a request that does not decode (a
//! string field holding invalid UTF-8, a truncated message) is the client's fault,
//! INVALID_ARGUMENT, not INTERNAL as tonic-prost answers.

use prost::Message;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstEncoder};

#[derive(Debug, Clone, Default)]
pub struct ProtoCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Codec for ProtoCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProtoDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProtoDecoder(PhantomData)
    }
}

#[derive(Debug, Clone)]
pub struct ProtoDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for ProtoDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
