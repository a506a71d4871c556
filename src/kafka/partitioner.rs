//! Where librdkafka's `murmur2` and `murmur2_random` partitioners put a key: the
//! Java client's default placement (`org.apache.kafka.common.utils.Utils.murmur2`),
//! which the relay uses by default so that keys land where other Kafka clients would
//! put them. A resync (`cdc::backlog`) asks it which partition a key's records go to
//! now; the tests ask it where the producer should have put each key.

/// The partition the `murmur2` partitioner puts `key` in among `partitions`: the
/// positive 32-bit murmur2 hash modulo the count (`None` without partitions).
#[must_use]
pub fn murmur2_partition(key: &[u8], partitions: usize) -> Option<i32> {
    let n = u32::try_from(partitions).ok().filter(|n| *n > 0)?;
    i32::try_from((murmur2(key) & 0x7fff_ffff) % n).ok()
}

/// Kafka's murmur2 (seed `0x9747b28c`), as unsigned: the Java `int` it returns has
/// the same 32 bits.
#[must_use]
pub fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    // Kafka hashes the length as an int: keys above 4 GiB do not exist.
    let mut h: u32 = 0x9747_b28c ^ u32::try_from(data.len()).unwrap_or(u32::MAX);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if let Some(&first) = tail.first() {
        h ^= u32::from(first);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_placed_as_the_java_client_places_them() {
        // Kafka's own test vectors (UtilsTest.testMurmur2), as signed ints.
        for (key, hash) in [
            ("21", -973_932_308_i32),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ] {
            assert_eq!(murmur2(key.as_bytes()).cast_signed(), hash, "{key}");
        }
        assert_eq!(murmur2_partition(b"21", 1), Some(0));
        assert_eq!(murmur2_partition(b"21", 0), None);
    }
}
