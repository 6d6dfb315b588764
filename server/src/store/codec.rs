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
    let mut out = vec![0u8; bytes.len() * 2];
    hex_into(bytes, &mut out);
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// Writes `bytes` as lowercase hex into `out`, which must be twice as long.
pub fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    debug_assert_eq!(out.len(), bytes.len() * 2);
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// Parses lowercase or uppercase hex (digits only: no sign, no prefix).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let mut out = vec![0u8; s.len() / 2];
    unhex_into(s, &mut out)?;
    Some(out)
}

/// Parses hex into `out`: `s` must be exactly twice as long.
pub fn unhex_into(s: &str, out: &mut [u8]) -> Option<()> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let s = s.as_bytes();
    if s.len() != out.len() * 2 {
        return None;
    }
    for (pair, b) in s.chunks_exact(2).zip(out.iter_mut()) {
        *b = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_digits_only_and_round_trips() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xab, 0xff];
        assert_eq!(hex(&bytes), "00017f80abff");
        assert_eq!(unhex("00017f80abff").unwrap(), bytes);
        assert_eq!(unhex("00017F80ABFF").unwrap(), bytes);
        assert_eq!(unhex("").unwrap(), Vec::<u8>::new());
        for bad in ["0", "+f", "-1", "0x", "g0", " 1"] {
            assert_eq!(unhex(bad), None, "{bad:?}");
        }
    }

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
