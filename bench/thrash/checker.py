#!/usr/bin/python3
"""A client of a converge cluster that writes and verifies a volume over NBD while faults happen.

Every 4 KiB block it writes carries (volume tag, block, sequence) and a filler derived
from them, so a read can tell exactly which write it returns and whether the bytes are
intact. It records every acknowledged write; a read must return the last acked write of
that block or a later one this client issued (whose ack it has not seen), never older
data, never garbage. Runs until the stop file exists, then verifies every block it wrote
and prints a JSON summary on stdout.

It is given one NBD URI per node (`--uri`, repeated; any node serves any volume) and
starts on the first. When its node dies (kill -9), the connection breaks: the write in
flight is *unacked* (it may or may not have landed: reads accept the old or the new
content of that block until a later write is acked), the client reconnects through the
next node that accepts, and carries on. Whether the node died is asked of the kernel:
the server's PID (SO_PEERCRED of the connection) no longer runs, or stops running within
--exit-grace seconds (a node stopped cleanly, as a rolling restart does, closes its
connections before it exits). Client-visible errors,
counted in `io_errors`, are: an error reply to a read or write on a live connection, a
connection closed by a server that still runs, and a handshake that a running server
fails. Reads and writes are never retried on the same connection: an error is reported.

Uses Debian's python3-libnbd (run it with /usr/bin/python3).
"""
import argparse
import errno
import hashlib
import json
import os
import random
import socket
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


def server_pid(h):
    """PID of the process serving this connection (SO_PEERCRED of its unix socket)."""
    try:
        with socket.socket(fileno=os.dup(h.aio_get_fd())) as sk:
            cred = sk.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", cred)[0]
    except (OSError, nbd.Error):
        return None


def running(pid):
    """The process runs (an exited one, even a zombie, has an empty command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read() != b""
    except OSError:
        return False


def exits_within(pid, seconds):
    """The process has exited, or exits within `seconds`: a node stopped cleanly
    (SIGTERM: a rolling restart) closes its clients' connections first and exits once it
    has destaged and left the cluster; a node killed is gone already."""
    deadline = time.time() + seconds
    while running(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


class Lost(Exception):
    """The connection broke because the node serving it died: the request's outcome is
    unknown, and the worker has reconnected through another node."""


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
                          io_errors=0, verify_failures=0, unacked_writes=0,
                          lost_connections=0, reconnects=0, refused_connects=0)
        self.errors = []
        self.h = None
        self.node = 0  # index in args.uri of the node serving self.h
        self.pid = None  # its PID
        self.nodes_used = set()

    def connect(self, start):
        """Connects through the first node, from `start` on (cyclically), that accepts.
        A node whose socket refuses is not running; one that accepts and then fails the
        handshake is a client-visible error. Gives up after --connect-timeout seconds."""
        uris = self.a.uri
        deadline = time.time() + self.a.connect_timeout
        k = start
        while True:
            i = k % len(uris)
            k += 1
            h = nbd.NBD()
            try:
                h.connect_uri(uris[i])
            except nbd.Error as e:
                try:
                    h.close()
                except Exception:
                    pass
                if e.errnum in (errno.ECONNREFUSED, errno.ENOENT):
                    self.stats["refused_connects"] += 1
                else:
                    self.note_error("connect", f"node {i + 1}: {e}")
                if time.time() > deadline:
                    raise RuntimeError(f"no node accepted a connection for "
                                       f"{self.a.connect_timeout} s") from e
                if k % len(uris) == start % len(uris):
                    time.sleep(0.5)  # every node refused: wait for one to come back
                continue
            self.h, self.node, self.pid = h, i, server_pid(h)
            self.nodes_used.add(i + 1)
            return

    def note_error(self, what, msg):
        self.stats["io_errors"] += 1
        self.errors.append(dict(t=time.time(), node=self.node + 1, op=what, error=msg[:300]))

    def io(self, fn, what):
        """Runs fn(handle). An error reply on a live connection is recorded as an I/O error
        (None is returned); a connection that broke raises Lost once reconnected."""
        try:
            return fn(self.h)
        except nbd.Error as e:
            live = self.h.aio_is_ready() or self.h.aio_is_processing()
            if live:
                self.note_error(what, str(e))
                return None
            died = self.pid is not None and exits_within(self.pid, self.a.exit_grace)
            if died:
                self.stats["lost_connections"] += 1
            else:
                self.note_error(what, f"connection closed by node {self.node + 1} "
                                      f"(pid {self.pid}), which still runs: {e}")
            try:
                self.h.close()
            except Exception:
                pass
            self.stats["reconnects"] += 1
            self.connect(self.node + 1)
            if died:
                raise Lost() from e
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
        self.errors.append(dict(t=time.time(), node=self.node + 1, op="verify", block=block,
                                error=why))
        return False

    def write(self, block):
        """Writes a new seq to block; True once acked. An unacked seq stays in `issued`, so
        reads accept it or the older content until a later write of the block is acked."""
        self.seq += 1
        seq = self.seq
        self.issued.setdefault(block, set()).add(seq)
        data = block_bytes(self.a.tag, block, seq)
        before = self.stats["io_errors"]
        try:
            self.io(lambda h: h.pwrite(data, block * BS), "write")
        except Lost:
            self.stats["unacked_writes"] += 1
            return False
        # pwrite returns None on success too: success is told by the error count.
        if self.stats["io_errors"] != before:
            self.stats["unacked_writes"] += 1
            return False
        self.acked[block] = seq
        # Older seqs can no longer be returned.
        self.issued[block] = {s for s in self.issued[block] if s >= seq}
        self.stats["writes"] += 1
        self.stats["bytes_written"] += BS
        return True

    def read(self, block, what):
        try:
            data = self.io(lambda h: h.pread(BS, block * BS), what)
        except Lost:
            return None
        if data is not None:
            self.stats["reads"] += 1
            self.check(block, data)
        return data

    def run(self):
        try:
            self.connect(self.a.first)
            while not self.stop.is_set():
                block = self.rng.choice(self.blocks)
                if self.rng.random() < self.a.write_fraction:
                    self.write(block)
                else:
                    self.read(block, "read")
            # Final pass: every block written must hold its last acked write (or a later
            # unacked one). A read lost with its node is read again through the next node.
            for block in sorted(self.issued):
                for _ in range(len(self.a.uri)):
                    if self.read(block, "final read") is not None:
                        break
            try:
                self.h.shutdown()
            except Exception:
                pass
        except Exception as e:  # noqa: BLE001 - reported, and fails the run
            self.note_error("worker", f"stopped: {type(e).__name__}: {e}")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--uri", required=True, action="append",
                   help="NBD URI of the volume on one node; repeat it for every node")
    p.add_argument("--first", type=int, default=0,
                   help="index of the --uri the workers connect through first")
    p.add_argument("--tag", type=int, required=True, help="volume tag stamped in blocks")
    p.add_argument("--blocks", type=int, default=16384, help="blocks used (from 0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-fraction", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--connect-timeout", type=float, default=300,
                   help="seconds a worker tries the nodes in turn before it gives up")
    p.add_argument("--stop-file", required=True)
    p.add_argument("--exit-grace", type=float, default=120,
                   help="seconds a node that closed our connection may take to exit before "
                        "the close counts as an error (a clean stop closes, then exits)")
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
    total["nodes_used"] = sorted(set().union(*(w.nodes_used for w in ws)))
    total["errors"] = [e for w in ws for e in w.errors][:50]
    print(json.dumps(total))
    sys.exit(0)


if __name__ == "__main__":
    main()
