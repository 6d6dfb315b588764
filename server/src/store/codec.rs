//! Value encoding: one format-version byte, then a protobuf body, so records can evolve
//! (new fields are added compatibly; a new version byte marks an incompatible change).

use prost::Message;

use super::StoreError;

/// The current value format.
const VERSION: u8 = 1;

/// Encodes a record.
pub fn encode<M: Message>(record: &M) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + record.encoded_len());
    out.push(VERSION);
    record
        .encode(&mut out)
        .expect("a Vec grows to fit any message");
    out
}

/// Decodes a record stored under `key`.
pub fn decode<M: Message + Default>(key: &[u8], bytes: &[u8]) -> Result<M, StoreError> {
    let corrupt = |why: String| StoreError::Corrupt { key: hex(key), why };
    match bytes.split_first() {
        Some((&VERSION, body)) => M::decode(body).map_err(|e| corrupt(e.to_string())),
        Some((v, _)) => Err(corrupt(format!("unknown value format version {v}"))),
        None => Err(corrupt("empty value".into())),
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// Parses lowercase or uppercase hex.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Probe {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(uint64, tag = "2")]
        n: u64,
    }

    #[test]
    fn round_trips_and_rejects_unknown_versions() {
        let p = Probe {
            name: "x".into(),
            n: 7,
        };
        let bytes = encode(&p);
        assert_eq!(bytes[0], VERSION);
        assert_eq!(decode::<Probe>(b"k", &bytes).unwrap(), p);
        let mut future = bytes.clone();
        future[0] = 2;
        assert!(decode::<Probe>(b"k", &future).is_err());
        assert!(decode::<Probe>(b"k", &[]).is_err());
    }

    #[test]
    fn hex_round_trips() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex("0001abff").unwrap(), b);
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
    }
}
