//! The checkers' view of a parity slab (variant `parity`). Its chunks are not copies, so
//! they are judged row by row (row `r` = block `r` of every chunk; data chunk `j`'s block
//! holds volume block `r·K + j` of the slab): per row, which versions K chunks hold intact
//! (only those can be read back, decoded), whether every chunk holding such a version
//! agrees with what K of them decode to (parity verifies), and the row's volume data at
//! each of them, for the clients' history check.

use converge_types::{DriveId, NodeId, Version, BLOCK_SIZE};
use converge_volume::parity::{Codec, Shard};
use std::collections::BTreeMap;

const BS: usize = BLOCK_SIZE;

/// One chunk of a slab, read whole from its drive.
pub(crate) struct Chunk {
    /// Its place in the slab's record: data chunks `0..K`, then parity `K..K+M`.
    pub c: usize,
    pub node: NodeId,
    pub drive: DriveId,
    pub data: Vec<u8>,
    pub versions: Vec<Version>,
    /// Rows whose block fails its checksum.
    pub bad: Vec<u32>,
}

impl Chunk {
    pub fn intact(&self, row: usize) -> bool {
        !self.bad.contains(&(row as u32))
    }

    pub fn block(&self, row: usize) -> &[u8] {
        &self.data[row * BS..(row + 1) * BS]
    }
}

/// A version of a row that at least K chunks hold intact, with the row's volume data
/// decoded from K of them (K blocks, in volume order).
pub(crate) struct RowVersion {
    pub row: usize,
    pub version: Version,
    /// The chunks (record positions) holding the row intact at this version.
    pub holders: Vec<usize>,
    pub data: Vec<u8>,
}

/// A chunk holding a row at a version K chunks hold, whose block is not what those K
/// decode to: the row's chunks are inconsistent (parity does not verify).
pub(crate) struct Mismatch {
    pub row: usize,
    pub version: Version,
    pub chunk: usize,
    /// The chunks the row was decoded from.
    pub from: Vec<usize>,
}

/// What the rows of one slab's chunks come to.
#[derive(Default)]
pub(crate) struct Judged {
    pub versions: Vec<RowVersion>,
    /// Rows at which no version is held intact by K chunks (unreadable as they stand).
    pub undecodable: Vec<usize>,
    pub mismatches: Vec<Mismatch>,
}

/// Judges the rows of one slab from the chunks given (any subset of its `k + m` chunks,
/// each read whole: `rows` blocks). Rows are decoded in one codec call per set of K chunks
/// decoded from (the codec works position by position, so whole chunks go in at once).
pub(crate) fn judge(k: usize, m: usize, rows: usize, chunks: &[Chunk]) -> Judged {
    let mut out = Judged::default();
    // Per row, each version's holders (chunks intact at it), in chunk order.
    let mut items: Vec<(usize, Version, Vec<usize>)> = Vec::new();
    for r in 0..rows {
        let mut by_version: BTreeMap<Version, Vec<usize>> = BTreeMap::new();
        for ch in chunks.iter().filter(|ch| ch.intact(r)) {
            by_version.entry(ch.versions[r]).or_default().push(ch.c);
        }
        let mut decodable = false;
        for (v, mut holders) in by_version {
            if holders.len() >= k {
                holders.sort_unstable();
                items.push((r, v, holders));
                decodable = true;
            }
        }
        if !decodable {
            out.undecodable.push(r);
        }
    }
    // Decoded from the first K holders (data chunks first: no decoding when they are all
    // there), grouped by those K.
    let mut groups: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
    for (i, (_, _, holders)) in items.iter().enumerate() {
        groups.entry(holders[..k].to_vec()).or_default().push(i);
    }
    let by_c: BTreeMap<usize, &Chunk> = chunks.iter().map(|ch| (ch.c, ch)).collect();
    let len = rows * BS;
    let mut codec = Codec::new(k as u8, m as u8).expect("the slab's shape makes a codec");
    let mut decoded: Vec<Vec<u8>> = vec![Vec::new(); k + m];
    for (from, members) in groups {
        for (c, buf) in decoded.iter_mut().enumerate() {
            buf.clear();
            if !from.contains(&c) {
                buf.resize(len, 0);
            }
        }
        {
            let mut shards: Vec<Shard<'_>> = decoded
                .iter_mut()
                .enumerate()
                .map(|(c, buf)| {
                    if from.contains(&c) {
                        Shard::Have(&by_c[&c].data[..])
                    } else {
                        Shard::Want(&mut buf[..])
                    }
                })
                .collect();
            codec
                .reconstruct(&mut shards)
                .expect("K equal, whole-block shards reconstruct");
        }
        let block = |c: usize, r: usize| -> &[u8] {
            if from.contains(&c) {
                by_c[&c].block(r)
            } else {
                &decoded[c][r * BS..(r + 1) * BS]
            }
        };
        for i in members {
            let (r, version, holders) = &items[i];
            for &c in holders.iter().filter(|c| !from.contains(c)) {
                if by_c[&c].block(*r) != block(c, *r) {
                    out.mismatches.push(Mismatch {
                        row: *r,
                        version: *version,
                        chunk: c,
                        from: from.clone(),
                    });
                }
            }
            let mut data = Vec::with_capacity(k * BS);
            for j in 0..k {
                data.extend_from_slice(block(j, *r));
            }
            out.versions.push(RowVersion {
                row: *r,
                version: *version,
                holders: holders.clone(),
                data,
            });
        }
    }
    out.versions.sort_by_key(|rv| (rv.row, rv.version));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of a 2+1 slab of `rows` rows, every row at version 1, data blocks filled
    /// with `fill(row, chunk)`, parity encoded.
    fn slab(rows: usize, fill: impl Fn(usize, usize) -> u8) -> Vec<Chunk> {
        let (k, m) = (2, 1);
        let data: Vec<Vec<u8>> = (0..k)
            .map(|j| {
                (0..rows)
                    .flat_map(|r| std::iter::repeat_n(fill(r, j), BS))
                    .collect()
            })
            .collect();
        let mut parity = vec![vec![0u8; rows * BS]; m];
        let mut codec = Codec::new(k as u8, m as u8).unwrap();
        let d: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
        let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|p| &mut p[..]).collect();
        codec.encode(&d, &mut p).unwrap();
        data.into_iter()
            .chain(parity)
            .enumerate()
            .map(|(c, data)| Chunk {
                c,
                node: NodeId(c as u32 + 1),
                drive: DriveId(c as u64 + 10),
                data,
                versions: vec![Version(1); rows],
                bad: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn rows_decode_from_any_k_and_wrong_parity_is_found() {
        let chunks = slab(3, |r, j| (r * 2 + j + 1) as u8);
        let j = judge(2, 1, 3, &chunks);
        assert!(j.undecodable.is_empty() && j.mismatches.is_empty());
        assert_eq!(j.versions.len(), 3);
        assert_eq!(j.versions[1].data[0], 3);
        assert_eq!(j.versions[1].data[BS], 4);
        // Data chunk 0 away: decoded from chunk 1 and parity.
        let j = judge(2, 1, 3, &chunks[1..]);
        assert_eq!(j.versions[2].data[0], 5);
        assert_eq!(j.versions[2].data[BS], 6);
        // A parity block that does not match its data.
        let mut chunks = chunks;
        chunks[2].data[BS + 7] ^= 1;
        let j = judge(2, 1, 3, &chunks);
        assert_eq!(j.mismatches.len(), 1);
        assert_eq!((j.mismatches[0].row, j.mismatches[0].chunk), (1, 2));
        // A row half written (chunk 0 at a newer version): nothing K chunks hold at it, and
        // the old version is only on chunk 1 and the parity.
        chunks[2].data[BS + 7] ^= 1;
        chunks[0].versions[0] = Version(2);
        let j = judge(2, 1, 3, &chunks);
        assert!(j.mismatches.is_empty() && j.undecodable.is_empty());
        assert_eq!(j.versions[0].holders, vec![1, 2]);
        assert_eq!(j.versions[0].data[0], 1);
        chunks[1].bad.push(0);
        assert_eq!(judge(2, 1, 3, &chunks).undecodable, vec![0]);
    }
}
