"""A verifying NBD client (libnbd) that reconnects, as qemu does with reconnect-delay.

Usage: /usr/bin/python3 reconnecting_verifier.py URI STOP_FILE REGION_BYTES

Writes 64 KiB blocks with a pattern byte that changes on every write and reads back blocks
already written, comparing each with what was last written there, until STOP_FILE exists;
then reads back every block written once more. When the connection breaks (the node it is
attached to restarts), it reconnects to the same URI (waiting up to 120 s) and repeats the
request that failed: a write is idempotent (same bytes), a read is asked again. Anything
else - a mismatch, an error answer on a live connection - is counted, never retried.
Prints one JSON line: ops, reconnects, mismatches, errors.
"""
import json
import os
import random
import sys
import time

import nbd

BLOCK = 64 * 1024
uri, stop_file, region = sys.argv[1], sys.argv[2], int(sys.argv[3])
blocks = region // BLOCK
rng = random.Random(4242)
model = {}
stats = {"ops": 0, "reconnects": 0, "mismatches": 0, "errors": 0, "first_problem": None}


def connect():
    deadline = time.monotonic() + 120
    while True:
        h = nbd.NBD()
        try:
            h.connect_uri(uri)
            return h
        except nbd.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def connection_lost(h, e):
    # A broken connection: libnbd's handle is no longer connected (EPIPE, ECONNRESET,
    # ENOTCONN, or the server closed). An error answer leaves the handle connected.
    try:
        return h.aio_is_dead() or h.aio_is_closed() or not h.aio_is_ready()
    except nbd.Error:
        return True


def problem(kind, msg):
    stats[kind] += 1
    if stats["first_problem"] is None:
        stats["first_problem"] = msg


h = connect()


def do(op, *args):
    global h
    while True:
        try:
            return op(h, *args)
        except nbd.Error as e:
            if not connection_lost(h, e):
                raise
            try:
                h.close()
            except Exception:
                pass
            stats["reconnects"] += 1
            h = connect()


def write(h, b, p):
    h.pwrite(bytes([p]) * BLOCK, b * BLOCK)


def read(h, b):
    return h.pread(BLOCK, b * BLOCK)


def check(b):
    try:
        got = do(read, b)
    except nbd.Error as e:
        problem("errors", f"read of block {b}: {e}")
        return
    want = model[b]
    if got != bytes([want]) * BLOCK:
        bad = next(i for i in range(BLOCK) if got[i] != want)
        problem("mismatches", f"block {b}: byte {bad} is {got[bad]}, expected {want}")


seq = 0
while not os.path.exists(stop_file):
    b = rng.randrange(blocks)
    seq += 1
    p = seq % 255 + 1
    try:
        do(write, b, p)
        model[b] = p
    except nbd.Error as e:
        problem("errors", f"write of block {b}: {e}")
    stats["ops"] += 1
    if model:
        check(rng.choice(list(model)))
        stats["ops"] += 1

for b in sorted(model):
    check(b)
stats["blocks_written"] = len(model)
print(json.dumps(stats))
