#!/usr/bin/python3
"""A client that writes and verifies a converge volume over NBD while faults happen.

Every 4 KiB block it writes carries (volume tag, block, sequence) and a filler derived
from them, so a read can tell exactly which write it returns and whether the bytes are
intact. It records every acknowledged write; a read must return the last acked write of
that block or a later one this client issued (whose ack it has not seen), never older
data, never garbage. Runs until the stop file exists, then verifies every block it wrote
and prints a JSON summary on stdout.

Uses Debian's python3-libnbd (run it with /usr/bin/python3).
"""
import argparse
import hashlib
import json
import os
import random
import struct
import sys
import threading
import time

import nbd

BS = 4096
MAGIC = b"CVCK"


def block_bytes(tag, block, seq):
    head = MAGIC + struct.pack("<IQQ", tag, block, seq)
    fill = hashlib.blake2b(head, digest_size=64).digest() * (BS // 64)
    return head + fill[len(head):]


class Worker(threading.Thread):
    def __init__(self, args, idx, blocks, stop):
        super().__init__(daemon=True)
        self.a = args
        self.idx = idx
        self.blocks = blocks  # the blocks this worker owns
        self.stop = stop
        self.acked = {}  # block -> last acked seq
        self.issued = {}  # block -> set of seqs issued but not known to be superseded
        self.seq = 0
        self.rng = random.Random(args.seed * 1000 + idx)
        self.stats = dict(writes=0, reads=0, bytes_written=0, bytes_verified=0,
                          io_errors=0, verify_failures=0, reconnects=0)
        self.errors = []
        self.h = None

    def connect(self):
        while True:
            try:
                h = nbd.NBD()
                h.connect_uri(self.a.uri)
                self.h = h
                return
            except nbd.Error as e:
                self.note_error("connect", str(e))
                time.sleep(0.5)
                if self.stop.is_set() and self.a.no_retry_after_stop:
                    raise

    def note_error(self, what, msg):
        self.stats["io_errors"] += 1
        self.errors.append(dict(t=time.time(), op=what, error=msg[:300]))

    def io(self, fn, what):
        """Runs fn(handle); on error records it and reconnects; returns None on error."""
        try:
            return fn(self.h)
        except nbd.Error as e:
            self.note_error(what, str(e))
            self.stats["reconnects"] += 1
            try:
                self.h.close()
            except Exception:
                pass
            self.connect()
            return None

    def check(self, block, data):
        self.stats["bytes_verified"] += BS
        acked = self.acked.get(block)
        if data == b"\0" * BS:
            if acked is None:
                return True
            return self.fail(block, f"zeros, but seq {acked} was acked")
        if data[:4] != MAGIC:
            return self.fail(block, "not written by this checker (garbage)")
        tag, b, seq = struct.unpack("<IQQ", data[4:24])
        if tag != self.a.tag or b != block:
            return self.fail(block, f"holds volume {tag} block {b}")
        if data != block_bytes(tag, b, seq):
            return self.fail(block, f"seq {seq}: bytes damaged")
        if acked is not None and seq < acked:
            return self.fail(block, f"seq {seq} is older than acked seq {acked} (lost write)")
        if seq not in self.issued.get(block, ()):
            return self.fail(block, f"seq {seq} was never written to this block")
        return True

    def fail(self, block, why):
        self.stats["verify_failures"] += 1
        self.errors.append(dict(t=time.time(), op="verify", block=block, error=why))
        return False

    def write(self, block):
        self.seq += 1
        seq = self.seq
        self.issued.setdefault(block, set()).add(seq)
        data = block_bytes(self.a.tag, block, seq)
        # pwrite returns None on success too: the caller tells success by the error count.
        self.io(lambda h: h.pwrite(data, block * BS), "write")
        return seq

    def run(self):
        self.connect()
        while not self.stop.is_set():
            block = self.rng.choice(self.blocks)
            if self.rng.random() < self.a.write_fraction:
                before = self.stats["io_errors"]
                seq = self.write(block)
                if self.stats["io_errors"] == before:
                    self.acked[block] = seq
                    # Older seqs can no longer be returned.
                    self.issued[block] = {s for s in self.issued[block] if s >= seq}
                    self.stats["writes"] += 1
                    self.stats["bytes_written"] += BS
            else:
                data = self.io(lambda h: h.pread(BS, block * BS), "read")
                if data is not None:
                    self.stats["reads"] += 1
                    self.check(block, data)
        # Final pass: every block written must hold its last acked write (or later).
        for block in sorted(self.issued):
            data = self.io(lambda h: h.pread(BS, block * BS), "final read")
            if data is not None:
                self.check(block, data)
        try:
            self.h.shutdown()
        except Exception:
            pass


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--uri", required=True)
    p.add_argument("--tag", type=int, required=True, help="volume tag stamped in blocks")
    p.add_argument("--blocks", type=int, default=16384, help="blocks used (from 0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-fraction", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--no-retry-after-stop", action="store_true")
    a = p.parse_args()
    stop = threading.Event()
    ws = [Worker(a, i, list(range(i, a.blocks, a.threads)), stop) for i in range(a.threads)]
    t0 = time.time()
    for w in ws:
        w.start()
    while not os.path.exists(a.stop_file):
        time.sleep(0.2)
    stop.set()
    for w in ws:
        w.join()
    total = {k: sum(w.stats[k] for w in ws) for k in ws[0].stats}
    total["seconds"] = round(time.time() - t0, 1)
    total["errors"] = [e for w in ws for e in w.errors][:50]
    print(json.dumps(total))
    sys.exit(0)


if __name__ == "__main__":
    main()
