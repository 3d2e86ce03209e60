#!/usr/bin/env python3
"""The cache advisor's validation study (issue 18; docs/studies/cache-advice.md).

For each read set, a fresh 3-node lab (RAM drives) with one RAM cache drive per node in
mode read-write: a mirror-3 volume owned by node 1 is written whole, the caches are
flushed, then fio reads the first READ_SET bytes at random, 4 KiB, for PASSES passes.
Node 1 serves every read (the owner's copy), so its cache drive's read hits and misses
(/metrics) are the measured hit ratio; `converge advise cache --node 1 --json` gives the
predicted ones at the cache drive's size: the tier's own read-write policy simulated on the
sampled blocks (`at_tier_read_hit`) and an LRU cache's (`at_lru_read_hit`, what any cache
could). All count since the node started. Prints a Markdown table.

    bench/advise/study.py [--bin target/release] [--cache 256M] [--sets 128M,256M,384M,512M,1G]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def sh(args, env=None):
    return subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout


def size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip().upper())
    if not m:
        sys.exit(f"not a size: {s}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def one(conv, cache, read_set, passes, vol_size):
    labdir = tempfile.mkdtemp(prefix="cvadvise-", dir="/tmp")
    env = dict(os.environ, CONVERGE_LAB_DIR=labdir)
    try:
        sh([conv, "lab", "up", "--nodes", "3", "--ram", "--drive-size", "2G",
            "--cache-drives", "1", "--cache-size", cache, "--cache-in-ram", "--dir", labdir], env)
        sh([conv, "cache", "mode", "read-write"], env)
        sh([conv, "volume", "create", "v", "--size", str(vol_size), "--resiliency", "mirror-3",
            "--owner", "1"], env)
        uri = json.loads(sh([conv, "volume", "show", "v", "--json"], env))["uri"]
        sh(["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
            "--iodepth=4", f"--size={vol_size}", "--output-format=terse"])
        sh([conv, "cache", "flush"], env)
        sh(["fio", "--name=read", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
            "--bs=4k", "--iodepth=8", f"--size={read_set}", f"--loops={passes}", "--randrepeat=0",
            "--output-format=terse"])
        lab = json.load(open(os.path.join(labdir, "lab.json")))
        api = lab["nodes"][0]["api"]
        token = open(os.path.join(labdir, "admin.token")).read().strip()
        text = sh(["curl", "-sf", "--cacert", os.path.join(labdir, "pki", "ca.crt"),
                   "-H", f"Authorization: Bearer {token}", f"{api}/metrics"])
        adv = json.loads(sh([conv, "advise", "cache", "--node", "1", "--json"], env))[0]
        cache_bytes = adv["advice"]["cache_bytes"]
        assert adv["at_bytes"] == cache_bytes, adv["at_bytes"]
        predicted = adv["at_lru_read_hit"]
        tier = adv["at_tier_read_hit"]
        m = adv["advice"]["mrc"]
        # Node 1's cache counters.
        hits = metric(text, "converge_cache_read_hit_blocks_total")
        misses = metric(text, "converge_cache_read_miss_blocks_total")
        return {
            "read_set": read_set, "cache_bytes": cache_bytes,
            "predicted": predicted, "tier": tier,
            "measured": hits / (hits + misses) if hits + misses else None,
            "admitted": metric(text, "converge_cache_admitted_blocks_total"),
            "evicted": metric(text, "converge_cache_evicted_blocks_total"),
            "tier_sim": adv["advice"].get("tier", []),
            "reads": m["reads"], "hits": hits, "misses": misses,
            "working_set_mib": m["blocks"] * 4096 / 2**20, "rate": m["rate"],
        }
    finally:
        subprocess.run([conv, "lab", "down", "--purge", "--dir", labdir], env=env,
                       capture_output=True)
        shutil.rmtree(labdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release")
    ap.add_argument("--cache", default="256M")
    ap.add_argument("--sets", default="128M,256M,384M,512M,1G")
    ap.add_argument("--passes", type=int, default=4)
    a = ap.parse_args()
    conv = os.path.join(os.path.abspath(a.bin), "converge")
    sets = [size(s) for s in a.sets.split(",")]
    vol = max(sets)
    rows = []
    for s in sets:
        r = one(conv, a.cache, s, a.passes, vol)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    def p(v):
        return "–" if v is None else "%.1f %%" % (100 * v)

    def d(a, b):
        return "–" if a is None or b is None else "%+.1f points" % (100 * (a - b))

    print("| read set | cache | reads | predicted: tier policy | predicted: LRU | measured read hit "
          "| measured − tier | measured − LRU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| %d MiB | %.0f MiB | %.0f | %s | %s | %s | %s | %s |" % (
            r["read_set"] >> 20, r["cache_bytes"] / 2**20, r["reads"], p(r["tier"]),
            p(r["predicted"]), p(r["measured"]), d(r["measured"], r["tier"]),
            d(r["measured"], r["predicted"])))


if __name__ == "__main__":
    main()
