//! Where written data blocks sit in the drive file. The lab's fault injector flips bits in
//! blocks that hold data right now, so the corruption is one a read can observe; searching
//! the file for known patterns would need the test to know the data.

use crate::drive::{lock, Drive, Extent};
use converge_types::{ExtentKey, Version};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::sync::Arc;

/// One written 4 KiB data block and its place in the drive file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DataBlock {
    pub key: ExtentKey,
    /// Index of the block within its extent (slab), in 4 KiB units.
    pub block: u32,
    /// Byte offset of the block's data in the drive file or device.
    pub offset_bytes: u64,
    /// Version the block's metadata holds.
    pub version: Version,
    /// Blocks of the extent whose content lives in the same physical storage, this one
    /// included: just this block, or every member of its compressed group's stream
    /// (docs/adr/0010), which a flipped bit there damages together.
    pub members: Vec<u32>,
}

/// A uniform random sample of a drive's written blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DataBlockSample {
    /// Distinct blocks, sorted by extent and block.
    pub blocks: Vec<DataBlock>,
    /// Written blocks the sample was drawn from (to weigh samples of several drives).
    pub written_blocks: u64,
}

impl Drive {
    /// Up to `count` distinct blocks, chosen at random (reproducibly, by `seed`) among the
    /// blocks whose data region holds written content. Blocks with a write in flight are
    /// left out: their bytes are about to change anyway.
    pub fn sample_data_blocks(&self, count: usize, seed: u64) -> DataBlockSample {
        let mut extents: Vec<Arc<Extent>> = {
            let t = lock(&self.table);
            t.slots
                .iter()
                .filter_map(|s| s.live.clone())
                .filter(|e| e.shadow == 0)
                .collect()
        };
        extents.sort_by_key(|e| e.key);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out: Vec<DataBlock> = Vec::with_capacity(count.min(1 << 16));
        // Reservoir sampling: memory stays at `count` whatever the size of the drive.
        let mut seen: u64 = 0;
        for ext in extents {
            let m = lock(&ext.meta);
            for (b, meta) in m.blocks.iter().enumerate() {
                let b = b as u32;
                if !meta.has_data() || meta.is_bad() || m.overlay.contains_key(&b) {
                    continue;
                }
                seen += 1;
                let members = if meta.is_packed() {
                    let g0 = b - meta.member();
                    (g0..(g0 + meta.group_blocks()).min(m.blocks.len() as u32))
                        .filter(|&x| m.blocks[x as usize].same_storage(meta))
                        .collect()
                } else {
                    vec![b]
                };
                let item = DataBlock {
                    key: ext.key,
                    block: b,
                    offset_bytes: self.layout.phys_off(meta.phys),
                    version: Version(meta.version),
                    members,
                };
                if out.len() < count {
                    out.push(item);
                } else {
                    let j = rng.gen_range(0..seen);
                    if j < count as u64 {
                        out[j as usize] = item;
                    }
                }
            }
        }
        out.sort_by_key(|d| (d.key, d.block));
        DataBlockSample {
            blocks: out,
            written_blocks: seen,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Drive, DriveIdentity, FaultyFile, FormatOptions};
    use converge_types::{
        ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex, Version,
        VolumeId, BLOCK_SIZE,
    };
    use std::collections::BTreeSet;
    use std::sync::Arc;

    fn key(s: u64) -> ExtentKey {
        ExtentKey {
            volume: VolumeId(9),
            slab: SlabIndex(s),
        }
    }

    fn drive() -> (FaultyFile, Drive) {
        let f = FaultyFile::new(16 << 20);
        let id = DriveIdentity {
            cluster: ClusterId(1),
            node: NodeId(1),
            drive: DriveId(5),
            slab_size_bytes: 1 << 20,
            role: DriveRole::Capacity,
            media: MediaType::Ssd,
        };
        let opts = FormatOptions {
            journal_bytes: Some(256 << 10),
            ..Default::default()
        };
        let d = Drive::format_with(Arc::new(f.clone()), id, opts).unwrap();
        (f, d)
    }

    fn write(d: &Drive, k: ExtentKey, block: u64, n: usize, v: u64) {
        let data = vec![0x5au8; n * BLOCK_SIZE];
        let crcs: Vec<u32> = data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect();
        d.write(k, Epoch(1), Version(v), block * 4096, &data, &crcs)
            .unwrap();
    }

    #[test]
    fn samples_only_written_blocks_at_their_file_offsets() {
        let (f, d) = drive();
        assert_eq!(
            d.sample_data_blocks(5, 1),
            Default::default(),
            "blank drive"
        );
        write(&d, key(0), 10, 4, 1); // blocks 10..14 of slab 0
        write(&d, key(3), 0, 2, 2); // blocks 0..2 of slab 3
        d.zero(key(0), Epoch(1), Version(3), 11 * 4096, 4096)
            .unwrap(); // block 11 zeroed
        let written: BTreeSet<(u64, u32)> = [(0, 10), (0, 12), (0, 13), (3, 0), (3, 1)]
            .into_iter()
            .collect();
        let all = d.sample_data_blocks(100, 7);
        assert_eq!(all.written_blocks, 5);
        let all = all.blocks;
        let got: BTreeSet<(u64, u32)> = all.iter().map(|b| (b.key.slab.0, b.block)).collect();
        assert_eq!(got, written, "every written block, and only those");
        // A smaller sample: distinct written blocks, reproducible by seed.
        let s = d.sample_data_blocks(3, 42);
        assert_eq!(s, d.sample_data_blocks(3, 42));
        assert_eq!(s.written_blocks, 5);
        let s = s.blocks;
        assert_eq!(s.len(), 3);
        let distinct: BTreeSet<(u64, u32)> = s.iter().map(|b| (b.key.slab.0, b.block)).collect();
        assert_eq!(distinct.len(), 3);
        assert!(distinct.is_subset(&written));
        // The offsets are where the data lives: rot there and the read reports that block.
        let b = &s[0];
        f.rot(b.offset_bytes + 123, 3);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let info = d
            .read(b.key, Epoch(1), u64::from(b.block) * 4096, &mut buf)
            .unwrap();
        assert_eq!(info.bad_blocks, vec![0], "{b:?}");
    }
}
