//! End-to-end: a deposed owner never answers a read with data older than an acked write.
//!
//! The owner of a mirror-3 volume is cut off from etcd and from its peers (its network
//! namespace's link is down) but not from its client, which reaches it through its unix
//! socket and keeps reading one block. Another node takes the volume over once the old
//! owner's lease has expired and acks a new write of that block. Every read the old
//! owner's client started after that ack must return the new data or an error, never the
//! old data: the old owner stops serving before its lease can expire (its tenure, by its
//! own monotonic clock), and the new owner claims only after the lease has expired.
//! No assertion is on a timing: only the order of events (a read started after the ack)
//! matters, and both clients stamp events with the same system-wide monotonic clock.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Reads block 0 of the export every 50 ms (asynchronously, so a read stuck in the old
/// owner does not stop new ones from being issued) until the file `stop` exists, then
/// waits for every read in flight. Prints one line per read: start and end on
/// CLOCK_MONOTONIC, and what it returned: the first byte of the block or `ERR`.
const READER: &str = r#"
import nbd, os, sys, time
uri, stop = sys.argv[1], sys.argv[2]
h = nbd.NBD()
h.connect_uri(uri)
inflight = []
last = 0.0
stopping = False
while True:
    now = time.monotonic()
    if not stopping and os.path.exists(stop):
        stopping = True
    if not stopping and now - last >= 0.05 and len(inflight) < 100:
        buf = nbd.Buffer(4096)
        inflight.append((h.aio_pread(buf, 0), buf, time.monotonic()))
        last = now
    if stopping and not inflight:
        break
    h.poll(10)
    rest = []
    for cookie, buf, start in inflight:
        try:
            done = h.aio_command_completed(cookie)
        except nbd.Error as e:
            print("%.6f %.6f ERR %s" % (start, time.monotonic(), str(e).replace("\n", " ")), flush=True)
            continue
        if done:
            b = buf.to_bytearray()
            print("%.6f %.6f %02x" % (start, time.monotonic(), b[0]), flush=True)
        else:
            rest.append((cookie, buf, start))
    inflight = rest
"#;

/// Writes `byte` over block 0 and prints CLOCK_MONOTONIC once the write is acked.
const WRITER: &str = r#"
import nbd, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(bytes([int(sys.argv[2], 16)]) * 4096, 0)
print("%.6f" % time.monotonic(), flush=True)
h.shutdown()
"#;

fn python(script: &str, args: &[&str]) -> Command {
    // Debian's libnbd bindings load under the system interpreter.
    let mut c = Command::new("/usr/bin/python3");
    c.arg("-c").arg(script).args(args);
    c
}

#[test]
fn a_partitioned_owner_never_serves_data_older_than_an_acked_write() {
    require_root();
    let lab = Lab::up(3, &["--netns"]);
    lab.create_owned("fence", "64M", "mirror-3", 2);
    let old_uri = lab.uri_on("fence", 2);
    let new_uri = lab.uri_on("fence", 1);
    // Block 0 holds 0xaa everywhere, acked by the owner (node 2).
    must(&mut python(WRITER, &[&old_uri, "aa"]));

    let stop = lab.path().join("stop-reader");
    let mut reader = python(READER, &[&old_uri, stop.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the reader");
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let collector = {
        use std::io::BufRead;
        let lines = lines.clone();
        let out = reader.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines() {
                lines.lock().unwrap().push(l.unwrap());
            }
        })
    };
    // The reader is connected and has read the old data through node 2.
    lab.wait_for("the reader's first read", Duration::from_secs(60), || {
        lines.lock().unwrap().iter().any(|l| l.ends_with(" aa"))
    });

    // Cut the owner off from etcd and its peers; its unix socket still reaches it.
    lab.must(&["lab", "fault", "partition", "2"]);
    // Through node 1: forwarded to node 2 (unreachable), then taken over once node 2's
    // lease has expired; acked only by the new owner.
    let acked: f64 = must(&mut python(WRITER, &[&new_uri, "bb"]))
        .trim()
        .parse()
        .expect("ack time");
    // Keep reading through the old owner for a while after the ack, then heal it: its
    // clients are re-routed to the new owner.
    std::thread::sleep(Duration::from_secs(3));
    lab.must(&["lab", "fault", "heal", "2"]);
    lab.wait_for("node 2 is live again", Duration::from_secs(120), || {
        let n = lab.json(&["node", "list"]);
        n.as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == 2 && x["live"] == true)
    });
    // One more read through node 2 once healed must see the new data.
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(&stop, b"").unwrap();
    let out = reader.wait_with_output().expect("reader");
    collector.join().unwrap();
    let text = lines.lock().unwrap().join("\n");
    assert!(
        out.status.success(),
        "reader failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut after_ack = 0;
    let mut new_after_ack = 0;
    let mut old_before = 0;
    for line in text.lines() {
        let f: Vec<&str> = line.splitn(3, ' ').collect();
        let start: f64 = f[0].parse().unwrap();
        let what = f[2];
        if start < acked {
            old_before += usize::from(what == "aa");
            continue;
        }
        after_ack += 1;
        assert!(
            what == "bb" || what.starts_with("ERR"),
            "a read through the deposed owner started {:.3} s after the new write was acked and returned {what}\nreads:\n{text}\n{}",
            start - acked,
            lab.logs()
        );
        new_after_ack += usize::from(what == "bb");
    }
    // Not vacuous: the old owner served the old data before the cut, and reads started
    // after the ack did complete, some with the new data once node 2 was healed.
    assert!(old_before > 0, "no read before the ack saw 0xaa:\n{text}");
    assert!(after_ack > 0 && new_after_ack > 0, "reads:\n{text}");
    lab.must(&["lab", "down"]);
}
