#!/usr/bin/python3
"""What deduplication and compression would save on a set of disk images.

Measures before building (issue 15): reads raw disk images block by block and reports,
for the blocks that hold data (all-zero blocks are thin-provisioned holes already):

* dedup: unique 4 KiB blocks within each image and across all of them (the saving a
  cluster-wide block dedup index would give), and the index it would need (one entry of
  32 B hash + 8 B location per unique block);
* compression: per group of G blocks (4, 16, 64 KiB), the bytes each codec leaves, stored
  in whole 4 KiB blocks (converge allocates blocks; a group that does not shrink by a
  block is stored as is), for lz4 (frame, default level) and zstd level 1 and 3, with the
  CPU time per GiB of input on this machine.

Run under /usr/bin/python3 (Debian's python3-lz4 and python3-zstandard):

    bench/savings/estimate.py IMAGE [IMAGE ...] [--json OUT]
"""

import argparse
import hashlib
import json
import sys
import time

BS = 4096
ZERO = bytes(BS)


def blocks(path):
    with open(path, "rb", buffering=1 << 20) as f:
        while True:
            b = f.read(BS)
            if not b:
                return
            if len(b) < BS:
                b = b + bytes(BS - len(b))
            yield b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("images", nargs="+")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--groups", default="1,4,16", help="group sizes in blocks")
    ap.add_argument(
        "--base",
        help="the template image the others were made from: blocks it holds are also "
        "counted apart (what clones of it share without any dedup index)",
    )
    a = ap.parse_args()
    try:
        import lz4.frame
        import zstandard
    except ImportError as e:
        sys.exit(
            f"{e}: install python3-lz4 and python3-zstandard and run under /usr/bin/python3"
        )
    groups = [int(g) for g in a.groups.split(",")]
    z1 = zstandard.ZstdCompressor(level=1)
    z3 = zstandard.ZstdCompressor(level=3)
    codecs = {
        "lz4": lambda d: len(lz4.frame.compress(d, store_size=False)),
        "zstd-1": lambda d: len(z1.compress(d)),
        "zstd-3": lambda d: len(z3.compress(d)),
    }
    base = set()
    if a.base:
        for b in blocks(a.base):
            if b != ZERO:
                base.add(hashlib.blake2b(b, digest_size=16).digest())
    everywhere = set()
    beyond = set()  # unique blocks not in the template
    beyond_total = 0
    per_image = []
    comp = {(c, g): [0, 0.0] for c in codecs for g in groups}  # stored bytes, seconds
    data_total = 0
    for path in a.images:
        seen = set()
        total = data = 0
        buf = {g: [] for g in groups}

        def flush(g, final=False):
            parts = buf[g]
            if not parts or (len(parts) < g and not final):
                return
            raw = b"".join(parts)
            for c, f in codecs.items():
                t = time.process_time()
                n = f(raw)
                comp[(c, g)][1] += time.process_time() - t
                stored = -(-n // BS) * BS
                comp[(c, g)][0] += min(stored, len(raw))
            buf[g] = []

        for b in blocks(path):
            total += 1
            if b == ZERO:
                continue
            data += 1
            h = hashlib.blake2b(b, digest_size=16).digest()
            seen.add(h)
            everywhere.add(h)
            if h not in base:
                beyond.add(h)
                beyond_total += 1
            for g in groups:
                buf[g].append(b)
                flush(g)
        for g in groups:
            flush(g, final=True)
        data_total += data
        per_image.append(
            {
                "image": path,
                "blocks": total,
                "data_blocks": data,
                "unique_blocks": len(seen),
            }
        )
    out = {
        "images": per_image,
        "data_bytes": data_total * BS,
        "unique_bytes_all": len(everywhere) * BS,
        "dedup_ratio": data_total / max(1, len(everywhere)),
        "dedup_index_bytes": len(everywhere) * 40,
        "base": a.base,
        "beyond_base_bytes": beyond_total * BS,
        "beyond_base_unique_bytes": len(beyond) * BS,
        "compression": [
            {
                "codec": c,
                "group_kib": g * BS // 1024,
                "stored_bytes": v[0],
                "saved_pct": 100.0 * (1 - v[0] / max(1, data_total * BS)),
                "cpu_s_per_gib": v[1] / max(1e-9, data_total * BS / (1 << 30)),
            }
            for (c, g), v in comp.items()
        ],
    }
    mib = lambda n: f"{n / (1 << 20):.0f} MiB"
    print("| image | size | data | unique within |")
    print("|---|---:|---:|---:|")
    for i in per_image:
        print(
            f"| {i['image'].split('/')[-1]} | {mib(i['blocks'] * BS)} | "
            f"{mib(i['data_blocks'] * BS)} | {mib(i['unique_blocks'] * BS)} |"
        )
    print(
        f"\nacross all: {mib(out['data_bytes'])} of data, {mib(out['unique_bytes_all'])} unique: "
        f"dedup {out['dedup_ratio']:.2f}:1, index {mib(out['dedup_index_bytes'])} "
        "(40 B per unique block)\n"
    )
    if a.base:
        print(
            f"not in the template: {mib(beyond_total * BS)}, of which {mib(len(beyond) * BS)} "
            f"unique: dedup beyond what clones share {beyond_total / max(1, len(beyond)):.2f}:1\n"
        )
    print("| codec | group | stored | saved | CPU s per GiB |")
    print("|---|---:|---:|---:|---:|")
    for r in out["compression"]:
        print(
            f"| {r['codec']} | {r['group_kib']} KiB | {mib(r['stored_bytes'])} | "
            f"{r['saved_pct']:.1f} % | {r['cpu_s_per_gib']:.2f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
