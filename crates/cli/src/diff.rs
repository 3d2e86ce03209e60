//! `converge volume export-diff` / `import-diff`: incremental backup to a file and restore
//! (docs/SNAPSHOTS.md "Incremental backup"; the file format is docs/FORMAT-diff.md).
//!
//! Export asks the API which runs changed between two snapshots (`/changes`, from the
//! copies' block metadata: nothing unchanged is read) and reads those runs from the newer
//! snapshot's read-only NBD export; without `--from` it copies the whole snapshot. Import
//! checks the file whole before it writes anything (a file; standard input is checked as
//! it goes), writes it through the volume's NBD export, and takes the newer snapshot on
//! the target, so the next diff of the chain applies on top of it.

use crate::http;
use anyhow::{anyhow, bail, Context, Result};
use converge_api::{Changes, CreateSnapshot, SnapshotInfo, VolumeInfo};
use converge_nbd::client::Client;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// First bytes of a diff file (format version 1).
pub const MAGIC: &[u8; 8] = b"CVGDIFF1";
pub const FORMAT_VERSION: u32 = 1;
const BS: u64 = 4096;
/// Largest data record's payload.
pub const RECORD_MAX: u64 = 4 << 20;
/// How much export reads at once (the client pipelines it in pieces).
const READ_CHUNK: u64 = 32 << 20;
/// Connections import writes through at once (the server offers multi-conn: a flush on
/// one covers the writes acked on all).
const IMPORT_CONNECTIONS: usize = 8;
const KIND_DATA: u8 = b'D';
const KIND_ZERO: u8 = b'Z';
const KIND_END: u8 = b'E';
const NAME_MAX: usize = 64;

/// What a diff file says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The volume's size at `to`.
    pub size: u64,
    /// The older snapshot; `None`: a full image.
    pub from: Option<String>,
    pub to: String,
}

impl Header {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&(BS as u32).to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        for name in [self.from.as_deref().unwrap_or(""), self.to.as_str()] {
            b.extend_from_slice(&(name.len() as u16).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    fn decode(r: &mut impl Read) -> Result<Header> {
        let mut fixed = [0u8; 24];
        r.read_exact(&mut fixed)
            .context("reading the diff header")?;
        if &fixed[..8] != MAGIC {
            bail!("not a converge diff file (it does not start with {MAGIC:?})");
        }
        let version = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            bail!("diff format version {version}; this converge reads version {FORMAT_VERSION}");
        }
        let bs = u32::from_le_bytes(fixed[12..16].try_into().expect("4 bytes"));
        if u64::from(bs) != BS {
            bail!("diff block size {bs}; only {BS} is known");
        }
        let size = u64::from_le_bytes(fixed[16..24].try_into().expect("8 bytes"));
        let mut all = fixed.to_vec();
        let mut names = Vec::new();
        for what in ["from", "to"] {
            let mut l = [0u8; 2];
            r.read_exact(&mut l).context("reading the diff header")?;
            let len = u16::from_le_bytes(l) as usize;
            if len > NAME_MAX {
                bail!(
                    "diff header: the {what} snapshot's name is {len} bytes (at most {NAME_MAX})"
                );
            }
            let mut n = vec![0u8; len];
            r.read_exact(&mut n).context("reading the diff header")?;
            all.extend_from_slice(&l);
            all.extend_from_slice(&n);
            names
                .push(String::from_utf8(n).map_err(|_| {
                    anyhow!("diff header: the {what} snapshot's name is not UTF-8")
                })?);
        }
        let mut c = [0u8; 4];
        r.read_exact(&mut c).context("reading the diff header")?;
        if u32::from_le_bytes(c) != crc32c::crc32c(&all) {
            bail!("diff header checksum mismatch: the file is damaged");
        }
        let to = names.pop().expect("two names");
        let from = names.pop().filter(|f| !f.is_empty());
        if to.is_empty() {
            bail!("diff header names no snapshot it leads to");
        }
        if size == 0 || !size.is_multiple_of(BS) {
            bail!("diff header: volume size {size} is not a positive multiple of {BS}");
        }
        Ok(Header { size, from, to })
    }
}

/// One record of the body.
#[derive(Debug, PartialEq, Eq)]
enum Record {
    Data {
        offset: u64,
        data: Vec<u8>,
    },
    Zero {
        offset: u64,
        len: u64,
    },
    End {
        records: u64,
        data_bytes: u64,
        zero_bytes: u64,
    },
}

fn put_record(w: &mut impl Write, r: &Record) -> Result<()> {
    let mut head = Vec::with_capacity(32);
    let payload: &[u8] = match r {
        Record::Data { offset, data } => {
            head.push(KIND_DATA);
            head.extend_from_slice(&offset.to_le_bytes());
            head.extend_from_slice(&(data.len() as u64).to_le_bytes());
            data
        }
        Record::Zero { offset, len } => {
            head.push(KIND_ZERO);
            head.extend_from_slice(&offset.to_le_bytes());
            head.extend_from_slice(&len.to_le_bytes());
            &[]
        }
        Record::End {
            records,
            data_bytes,
            zero_bytes,
        } => {
            head.push(KIND_END);
            head.extend_from_slice(&records.to_le_bytes());
            head.extend_from_slice(&data_bytes.to_le_bytes());
            head.extend_from_slice(&zero_bytes.to_le_bytes());
            &[]
        }
    };
    let crc = crc32c::crc32c_append(crc32c::crc32c(&head), payload);
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.write_all(&crc.to_le_bytes())?;
    Ok(())
}

/// Reads the next record, checking its checksum and that it lies in order within the
/// volume (`next`: the first offset it may start at).
fn get_record(r: &mut impl Read, size: u64, next: u64) -> Result<Record> {
    let mut kind = [0u8; 1];
    r.read_exact(&mut kind)
        .context("the diff ends before its end record (cut short?)")?;
    let mut head = vec![kind[0]];
    let field = |r: &mut dyn Read, head: &mut Vec<u8>| -> Result<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)
            .context("the diff ends inside a record (cut short?)")?;
        head.extend_from_slice(&b);
        Ok(u64::from_le_bytes(b))
    };
    let rec = match kind[0] {
        KIND_DATA | KIND_ZERO => {
            let offset = field(r, &mut head)?;
            let len = field(r, &mut head)?;
            if len == 0 || !offset.is_multiple_of(BS) || !len.is_multiple_of(BS) {
                bail!("diff record at {offset}: length {len} is not a positive number of 4 KiB blocks at a block boundary");
            }
            if offset < next || offset.checked_add(len).is_none_or(|e| e > size) {
                bail!("diff record at {offset} (+{len}) is out of order or past the volume's {size} bytes");
            }
            if kind[0] == KIND_DATA {
                if len > RECORD_MAX {
                    bail!("diff data record at {offset} is {len} bytes (at most {RECORD_MAX})");
                }
                let mut data = vec![0u8; len as usize];
                r.read_exact(&mut data)
                    .context("the diff ends inside a data record (cut short?)")?;
                Record::Data { offset, data }
            } else {
                Record::Zero { offset, len }
            }
        }
        KIND_END => Record::End {
            records: field(r, &mut head)?,
            data_bytes: field(r, &mut head)?,
            zero_bytes: field(r, &mut head)?,
        },
        k => bail!("diff record of unknown kind {k:#04x}: the file is damaged"),
    };
    let payload: &[u8] = match &rec {
        Record::Data { data, .. } => data,
        _ => &[],
    };
    let mut c = [0u8; 4];
    r.read_exact(&mut c)
        .context("the diff ends inside a record (cut short?)")?;
    if u32::from_le_bytes(c) != crc32c::crc32c_append(crc32c::crc32c(&head), payload) {
        bail!("diff record checksum mismatch: the file is damaged");
    }
    Ok(rec)
}

/// Counts kept while writing or reading a body, checked against its end record.
#[derive(Default, Debug, Clone, Copy)]
pub struct Totals {
    pub records: u64,
    pub data_bytes: u64,
    pub zero_bytes: u64,
}

/// Reads a body record by record: every data and zero record in order, then `None` once
/// the end record matched what came before it and nothing follows it.
struct Body<'a, R: Read> {
    r: &'a mut R,
    size: u64,
    next: u64,
    t: Totals,
}

impl<'a, R: Read> Body<'a, R> {
    fn new(r: &'a mut R, h: &Header) -> Self {
        Body {
            r,
            size: h.size,
            next: 0,
            t: Totals::default(),
        }
    }

    fn next(&mut self) -> Result<Option<Record>> {
        let rec = get_record(self.r, self.size, self.next)?;
        let t = &mut self.t;
        match &rec {
            Record::Data { offset, data } => {
                self.next = offset + data.len() as u64;
                t.data_bytes += data.len() as u64;
            }
            Record::Zero { offset, len } => {
                self.next = offset + len;
                t.zero_bytes += len;
            }
            Record::End {
                records,
                data_bytes,
                zero_bytes,
            } => {
                if (*records, *data_bytes, *zero_bytes) != (t.records, t.data_bytes, t.zero_bytes) {
                    bail!(
                        "diff end record says {records} records, {data_bytes} data and {zero_bytes} zero bytes; the file holds {} records, {} and {}: it is damaged",
                        t.records, t.data_bytes, t.zero_bytes
                    );
                }
                let mut extra = [0u8; 1];
                if self.r.read(&mut extra)? != 0 {
                    bail!("bytes follow the diff's end record: the file is damaged");
                }
                return Ok(None);
            }
        }
        t.records += 1;
        Ok(Some(rec))
    }
}

/// Walks a whole body, checking it; `apply` gets every data and zero record in order.
fn walk_body(
    r: &mut impl Read,
    h: &Header,
    mut apply: impl FnMut(&Record) -> Result<()>,
) -> Result<Totals> {
    let mut b = Body::new(r, h);
    while let Some(rec) = b.next()? {
        apply(&rec)?;
    }
    Ok(b.t)
}

/// The NBD socket in a `nbd+unix:///EXPORT?socket=PATH` URI the API gave.
fn socket_of(uri: &str) -> Result<PathBuf> {
    uri.split_once("socket=")
        .map(|(_, s)| PathBuf::from(s))
        .filter(|p| p.is_absolute())
        .ok_or_else(|| anyhow!("no NBD socket in {uri:?} (is the volume's owner up?)"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the I/O runtime")
}

fn snapshots(api: &str, volume: &str) -> Result<Vec<SnapshotInfo>> {
    http::call(api, "GET", &format!("/v1/volumes/{volume}/snapshots"), None)
}

/// What an export wrote.
pub struct Exported {
    pub header: Header,
    pub totals: Totals,
}

/// `converge volume export-diff VOLUME --to B [--from A] FILE|-`.
pub fn export(
    api: &str,
    volume: &str,
    from: Option<&str>,
    to: &str,
    out: &Path,
    socket: Option<&Path>,
) -> Result<Exported> {
    let snaps = snapshots(api, volume)?;
    let find = |n: &str| {
        snaps
            .iter()
            .find(|s| s.name == n)
            .ok_or_else(|| anyhow!("volume {volume} has no snapshot named {n}"))
    };
    let target = find(to)?;
    if let Some(f) = from {
        find(f)?;
    }
    let size = target.size_bytes;
    let runs: Vec<(u64, u64)> = match from {
        Some(f) => {
            let c: Changes = http::call(
                api,
                "GET",
                &format!("/v1/volumes/{volume}/changes?from={f}&to={to}"),
                None,
            )?;
            c.runs.iter().map(|r| (r.offset, r.length)).collect()
        }
        None => vec![(0, size)],
    };
    let socket = match socket {
        Some(s) => s.to_path_buf(),
        None => socket_of(&target.uri)?,
    };
    let header = Header {
        size,
        from: from.map(str::to_string),
        to: to.to_string(),
    };
    let to_stdout = out == Path::new("-");
    let tmp = out.with_extension("partial");
    let sink: Box<dyn Write> = if to_stdout {
        Box::new(std::io::stdout().lock())
    } else {
        if out.exists() {
            bail!(
                "{} exists: give a new file (nothing is overwritten)",
                out.display()
            );
        }
        Box::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        )
    };
    let mut w = BufWriter::with_capacity(1 << 20, sink);
    w.write_all(&header.encode())?;
    let export = format!("{volume}@{to}");
    let totals = runtime()?.block_on(async {
        let mut c = Client::connect_unix(&socket, &export)
            .await
            .with_context(|| format!("opening {export} at {}", socket.display()))?;
        if c.size() != size {
            bail!(
                "{export} is {} bytes, its snapshot record says {size}",
                c.size()
            );
        }
        let mut t = Totals::default();
        let mut buf = vec![0u8; READ_CHUNK as usize];
        for (start, len) in runs {
            let mut pos = start;
            while pos < start + len {
                let n = (start + len - pos).min(READ_CHUNK);
                let chunk = &mut buf[..n as usize];
                c.read(pos, chunk)
                    .await
                    .with_context(|| format!("reading {export} at {pos}"))?;
                emit(&mut w, pos, chunk, &mut t)?;
                pos += n;
            }
        }
        c.disconnect().await.ok();
        Ok(t)
    })?;
    put_record(
        &mut w,
        &Record::End {
            records: totals.records,
            data_bytes: totals.data_bytes,
            zero_bytes: totals.zero_bytes,
        },
    )?;
    let sink = w
        .into_inner()
        .map_err(|e| anyhow!("writing the diff: {}", e.error()))?;
    drop(sink);
    if !to_stdout {
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, out)
            .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    }
    Ok(Exported { header, totals })
}

/// Cuts `chunk` (read at `pos`) into runs of all-zero blocks and of data blocks.
fn emit(w: &mut impl Write, pos: u64, chunk: &[u8], t: &mut Totals) -> Result<()> {
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    let blocks: Vec<&[u8]> = chunk.chunks(BS as usize).collect();
    let mut i = 0;
    while i < blocks.len() {
        let z = zero(blocks[i]);
        let mut j = i + 1;
        // Data records stop at RECORD_MAX; zero runs go on.
        let most = if z {
            usize::MAX
        } else {
            (RECORD_MAX / BS) as usize
        };
        while j < blocks.len() && j - i < most && zero(blocks[j]) == z {
            j += 1;
        }
        let offset = pos + i as u64 * BS;
        let rec = if z {
            t.zero_bytes += (j - i) as u64 * BS;
            Record::Zero {
                offset,
                len: (j - i) as u64 * BS,
            }
        } else {
            t.data_bytes += (j - i) as u64 * BS;
            Record::Data {
                offset,
                data: chunk[i * BS as usize..j * BS as usize].to_vec(),
            }
        };
        put_record(w, &rec)?;
        t.records += 1;
        i = j;
    }
    Ok(())
}

/// Where the volume now first differs from its snapshot `snap` within the runs `c` lists
/// (None: nowhere).
fn first_difference(socket: &Path, volume: &str, snap: &str, c: &Changes) -> Result<Option<u64>> {
    runtime()?.block_on(async {
        let mut live = Client::connect_unix(socket, volume)
            .await
            .with_context(|| format!("opening {volume} at {}", socket.display()))?;
        let export = format!("{volume}@{snap}");
        let mut old = Client::connect_unix(socket, &export)
            .await
            .with_context(|| format!("opening {export} at {}", socket.display()))?;
        let mut a = vec![0u8; RECORD_MAX as usize];
        let mut b = vec![0u8; RECORD_MAX as usize];
        for r in &c.runs {
            let mut pos = r.offset;
            while pos < r.offset + r.length {
                let n = (r.offset + r.length - pos).min(RECORD_MAX) as usize;
                live.read(pos, &mut a[..n]).await?;
                old.read(pos, &mut b[..n]).await?;
                if let Some(i) = a[..n].iter().zip(&b[..n]).position(|(x, y)| x != y) {
                    return Ok(Some(pos + i as u64));
                }
                pos += n as u64;
            }
        }
        live.disconnect().await.ok();
        old.disconnect().await.ok();
        Ok(None)
    })
}

/// What an import did.
pub struct Imported {
    pub header: Header,
    pub totals: Totals,
    /// The snapshot taken on the target afterwards (None with `--no-snapshot`).
    pub snapshot: Option<String>,
}

/// `converge volume import-diff VOLUME FILE|-`.
pub fn import(
    api: &str,
    volume: &str,
    input: &Path,
    force: bool,
    take_snapshot: bool,
    socket: Option<&Path>,
) -> Result<Imported> {
    let from_stdin = input == Path::new("-");
    let open = || -> Result<Box<dyn Read>> {
        Ok(if from_stdin {
            Box::new(std::io::stdin().lock())
        } else {
            Box::new(
                std::fs::File::open(input)
                    .with_context(|| format!("opening {}", input.display()))?,
            )
        })
    };
    let mut r = BufReader::with_capacity(1 << 20, open()?);
    let header = Header::decode(&mut r)?;
    // A file is checked whole before anything is written: a damaged one changes nothing.
    if !from_stdin {
        walk_body(&mut r, &header, |_| Ok(()))
            .with_context(|| format!("checking {}", input.display()))?;
        r = BufReader::with_capacity(1 << 20, open()?);
        Header::decode(&mut r)?;
    }
    let v: VolumeInfo = http::call(api, "GET", &format!("/v1/volumes/{volume}"), None)?;
    if v.size_bytes > header.size {
        bail!(
            "volume {volume} is {} bytes, the diff's volume {} bytes: import into a volume of that size",
            v.size_bytes,
            header.size
        );
    }
    let snaps = snapshots(api, volume)?;
    if snaps.iter().any(|s| s.name == header.to) && take_snapshot {
        bail!(
            "volume {volume} already has a snapshot named {}: this diff was applied already, or \
             delete that snapshot first",
            header.to
        );
    }
    if let Some(f) = &header.from {
        if !snaps.iter().any(|s| &s.name == f) {
            bail!(
                "volume {volume} has no snapshot named {f}, which this diff starts from: import \
                 the chain in order (the full export first; each import takes its snapshot)"
            );
        }
        let c: Changes = http::call(
            api,
            "GET",
            &format!("/v1/volumes/{volume}/changes?from={f}"),
            None,
        )?;
        if c.changed_bytes > 0 && !force {
            // Written since (a rollback rewrites, too): refused unless those runs still
            // read as the snapshot does.
            let sock = match socket {
                Some(s) => s.to_path_buf(),
                None => socket_of(&v.uri)?,
            };
            if let Some(at) = first_difference(&sock, volume, f, &c)? {
                bail!(
                    "volume {volume} was written since its snapshot {f} ({} bytes rewritten, \
                     differing first at byte {at}), so the diff would not reproduce {}: roll it \
                     back first (`converge volume snapshot rollback {volume} {f} --yes`) or \
                     pass --force",
                    c.changed_bytes,
                    header.to
                );
            }
        }
    }
    if v.size_bytes < header.size {
        let body = serde_json::json!({ "size_bytes": header.size });
        let _: serde_json::Value = http::call(
            api,
            "POST",
            &format!("/v1/volumes/{volume}/resize"),
            Some(&body),
        )
        .with_context(|| format!("growing volume {volume} to the diff's size"))?;
    }
    let socket = match socket {
        Some(s) => s.to_path_buf(),
        None => socket_of(&v.uri)?,
    };
    let totals = runtime()?.block_on(async {
        let mut pool = Vec::with_capacity(IMPORT_CONNECTIONS);
        for _ in 0..IMPORT_CONNECTIONS {
            let c = Client::connect_unix(&socket, volume)
                .await
                .with_context(|| format!("opening {volume} at {}", socket.display()))?;
            if c.size() != header.size {
                bail!(
                    "export {volume} is {} bytes, the diff's volume {}",
                    c.size(),
                    header.size
                );
            }
            pool.push(c);
        }
        // Applied as read, each record on an idle connection (records never overlap, so
        // their order does not matter); a file was checked whole first, standard input is
        // checked as it goes, so a damaged stream stops the import part way.
        let mut running = tokio::task::JoinSet::new();
        let mut body = Body::new(&mut r, &header);
        while let Some(rec) = body.next()? {
            let mut c = match pool.pop() {
                Some(c) => c,
                None => {
                    let (c, r) = running.join_next().await.expect("a write runs")?;
                    r?;
                    c
                }
            };
            let volume = volume.to_string();
            running.spawn(async move {
                let r = match rec {
                    Record::Data { offset, data } => c
                        .write(offset, &data, false)
                        .await
                        .with_context(|| format!("writing {volume} at {offset}")),
                    Record::Zero { offset, len } => c
                        .write_zeroes(offset, len)
                        .await
                        .with_context(|| format!("zeroing {volume} at {offset}")),
                    Record::End { .. } => Ok(()),
                };
                (c, r)
            });
        }
        let totals = body.t;
        while let Some(done) = running.join_next().await {
            let (c, r) = done?;
            r?;
            pool.push(c);
        }
        for c in pool.iter_mut() {
            c.flush().await.context("flushing the volume")?;
        }
        for c in pool {
            c.disconnect().await.ok();
        }
        Ok::<_, anyhow::Error>(totals)
    })?;
    let snapshot = if take_snapshot {
        let body = serde_json::to_value(CreateSnapshot {
            name: header.to.clone(),
        })?;
        let _: SnapshotInfo = http::call(
            api,
            "POST",
            &format!("/v1/volumes/{volume}/snapshots"),
            Some(&body),
        )
        .with_context(|| format!("taking snapshot {} on {volume}", header.to))?;
        Some(header.to.clone())
    } else {
        None
    };
    Ok(Imported {
        header,
        totals,
        snapshot,
    })
}

#[cfg(test)]
mod tests {

    /// docs/FORMAT.md names this build's protocol, diff and fleet format versions (the
    /// engine's are checked by converge-engine's compat test).
    #[test]
    fn format_md_names_this_builds_versions() {
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/FORMAT.md"),
        )
        .unwrap();
        let row = |what: &str| {
            doc.lines()
                .find(|l| l.starts_with(&format!("| {what}")))
                .unwrap_or_else(|| panic!("docs/FORMAT.md has no row for {what}"))
                .to_string()
        };
        let p = converge_rpc::PROTOCOL_VERSION;
        let d = FORMAT_VERSION;
        let f = converge_fleet::model::FORMAT_VERSION;
        for (what, cells) in [
            (
                "peer protocol",
                format!("| rpc protocol {p} | rpc protocol {p} |"),
            ),
            (
                "incremental backup",
                format!("| diff format {d} | diff format {d} |"),
            ),
            (
                "fleet results",
                format!("| fleet format {f} | fleet format {f} |"),
            ),
        ] {
            let r = row(what);
            assert!(
                r.contains(&cells),
                "docs/FORMAT.md disagrees with the code: {r}"
            );
        }
    }
    use super::*;

    fn body(h: &Header, recs: &[Record]) -> Vec<u8> {
        let mut b = h.encode();
        for r in recs {
            put_record(&mut b, r).unwrap();
        }
        b
    }

    fn header() -> Header {
        Header {
            size: 1 << 20,
            from: Some("a".into()),
            to: "b".into(),
        }
    }

    fn read_all(bytes: &[u8]) -> Result<(Header, Vec<Record>)> {
        let mut r = bytes;
        let h = Header::decode(&mut r)?;
        let mut out = Vec::new();
        walk_body(&mut r, &h, |rec| {
            out.push(match rec {
                Record::Data { offset, data } => Record::Data {
                    offset: *offset,
                    data: data.clone(),
                },
                Record::Zero { offset, len } => Record::Zero {
                    offset: *offset,
                    len: *len,
                },
                Record::End { .. } => unreachable!(),
            });
            Ok(())
        })?;
        Ok((h, out))
    }

    #[test]
    fn a_diff_round_trips_and_every_damage_is_refused() {
        let mut chunk = vec![0u8; 16 * BS as usize];
        chunk[5 * BS as usize] = 7; // block 5: data, the rest zeros
        chunk[6 * BS as usize + 100] = 9; // block 6 too
        let mut recs_bytes = Vec::new();
        let mut t = Totals::default();
        emit(&mut recs_bytes, 64 * BS, &chunk, &mut t).unwrap();
        assert_eq!(
            (t.records, t.data_bytes, t.zero_bytes),
            (3, 2 * BS, 14 * BS)
        );
        let mut file = header().encode();
        file.extend_from_slice(&recs_bytes);
        put_record(
            &mut file,
            &Record::End {
                records: t.records,
                data_bytes: t.data_bytes,
                zero_bytes: t.zero_bytes,
            },
        )
        .unwrap();
        let (h, recs) = read_all(&file).unwrap();
        assert_eq!(h, header());
        assert_eq!(
            recs,
            vec![
                Record::Zero {
                    offset: 64 * BS,
                    len: 5 * BS
                },
                Record::Data {
                    offset: 69 * BS,
                    data: chunk[5 * BS as usize..7 * BS as usize].to_vec()
                },
                Record::Zero {
                    offset: 71 * BS,
                    len: 9 * BS
                },
            ]
        );
        // Every single flipped byte is caught (header, record heads, payloads, crcs).
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x10;
            assert!(read_all(&bad).is_err(), "byte {i} flipped went unnoticed");
        }
        // Cut short anywhere, or with bytes after the end: refused.
        for n in 0..file.len() {
            assert!(read_all(&file[..n]).is_err(), "cut at {n} went unnoticed");
        }
        let mut longer = file.clone();
        longer.push(0);
        assert!(read_all(&longer).is_err());
    }

    #[test]
    fn records_out_of_order_or_past_the_end_are_refused() {
        let h = header();
        let end = |n, d, z| Record::End {
            records: n,
            data_bytes: d,
            zero_bytes: z,
        };
        let overlap = body(
            &h,
            &[
                Record::Zero {
                    offset: 8 * BS,
                    len: 2 * BS,
                },
                Record::Zero {
                    offset: 9 * BS,
                    len: BS,
                },
                end(2, 0, 3 * BS),
            ],
        );
        let e = read_all(&overlap).unwrap_err().to_string();
        assert!(e.contains("out of order"), "{e}");
        let past = body(
            &h,
            &[
                Record::Zero {
                    offset: h.size - BS,
                    len: 2 * BS,
                },
                end(1, 0, 2 * BS),
            ],
        );
        let e = read_all(&past).unwrap_err().to_string();
        assert!(e.contains("past the volume"), "{e}");
        let unaligned = body(&h, &[Record::Zero { offset: 1, len: BS }, end(1, 0, BS)]);
        assert!(read_all(&unaligned).is_err());
        let miscount = body(&h, &[Record::Zero { offset: 0, len: BS }, end(2, 0, BS)]);
        let e = read_all(&miscount).unwrap_err().to_string();
        assert!(e.contains("end record"), "{e}");
        let e = read_all(b"NOTADIFF........................")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a converge diff"), "{e}");
    }
}
