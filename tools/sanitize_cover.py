#!/usr/bin/env python3
"""The sanitizer's test list: from a record of the CUDA suite (every test's launches of our
kernels, written under GPU_PUZZLES_RECORD_TEST_LAUNCHES by tests/conftest.py), the tests that
together make every distinct launch (kernel, block size, shared memory) that the whole suite
makes, cheapest cover first.

compute-sanitizer's hazards and faults depend on the kernel and its launch shape, and an
instrumented test runs 30-100x slower: the whole CUDA suite under memcheck, racecheck and
synccheck is hours on one GPU, while the cover checks every launch the suite makes in one call
per tool. Tests recorded as null (their launches could not be read: the record of 534b66a's
kernels was made before tests/conftest.py read a test's own profiler, and holds about 210 such
tests, 1,100 s plain) join the list when cheap (--unrecorded-max-s); the costlier ones are written
apart (<out>.unrecorded) and counted in the summary line, and a record step given the old record
in RECORD_SKIP records them again.

    python3 tools/sanitize_cover.py launches.jsonl --out cover.txt

Standard library only: it runs on the bare GPU machine.
"""
import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from racecheck_cases import choose  # noqa: E402

# Seconds added to each test's recorded time when weighing it: a test's start under the
# sanitizer costs more than its plain run suggests.
OVERHEAD_S = 1.0


def cover(records, overhead=OVERHEAD_S):
    """records: dicts {"test", "seconds", "launches" (list or None)}. Returns (chosen ids in the
    order picked, unrecorded ids (sorted), number of distinct launches)."""
    cases, cost, unrecorded = {}, {}, []
    for r in records:
        if r["launches"] is None:
            unrecorded.append(r["test"])
            continue
        cases[r["test"]] = {tuple(x) for x in r["launches"]}
        cost[r["test"]] = float(r["seconds"]) + overhead
    launches = set().union(*cases.values()) if cases else set()
    cases = {t: c for t, c in cases.items() if c}  # tests of none of our kernels add nothing
    return choose(cases, cost), sorted(set(unrecorded)), len(launches)


def read_records(paths):
    """{test id: its record} from record files (.jsonl or .jsonl.gz), merged in order: a test's
    last line wins (a cut record, then the call that finished it)."""
    merged = {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    merged[r["test"]] = r
    return merged


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("record", nargs="+",
                   help="JSON lines written under GPU_PUZZLES_RECORD_TEST_LAUNCHES (.jsonl or .jsonl.gz); several "
                        "records (a cut one and the call that finished it) are merged, a test's last line winning")
    p.add_argument("--out", required=True, help="test ids, one per line (tools/sanitize_queue.py --only)")
    p.add_argument("--overhead", type=float, default=OVERHEAD_S)
    p.add_argument("--unrecorded-max-s", type=float, default=2.0,
                   help="unrecorded tests up to this many seconds plain join the list; the rest go to <out>.unrecorded")
    p.add_argument("--collected", help="test ids the suite collects now, one per line: records of tests no longer "
                                        "there (renamed, reparametrised since an earlier record) are dropped")
    a = p.parse_args(argv)
    merged = read_records(a.record)
    gone = 0
    if a.collected:
        with open(a.collected) as f:
            now = {line.strip() for line in f if "::" in line}
        if now:  # an empty list is a failed collection, not a suite without tests
            gone = sum(t not in now for t in merged)
            merged = {t: r for t, r in merged.items() if t in now}
        else:
            print(f"--collected {a.collected} holds no test ids: every record kept")
    records = list(merged.values())
    chosen, unrecorded, n = cover(records, a.overhead)
    seconds = {r["test"]: r["seconds"] for r in records}
    cheap = [t for t in unrecorded if seconds[t] <= a.unrecorded_max_s]
    apart = [t for t in unrecorded if seconds[t] > a.unrecorded_max_s]
    with open(a.out, "w") as f:
        f.writelines(t + "\n" for t in chosen + cheap)
    with open(a.out + ".unrecorded", "w") as f:
        f.writelines(t + "\n" for t in apart)

    def plain(ts):  # their seconds, summed
        return sum(seconds[t] for t in ts)

    print(f"{len(records)} tests recorded, {n} distinct launches of our kernels; {len(chosen)} tests make all of "
          f"them ({plain(chosen):.0f} s plain); unrecorded (own profiler): {len(cheap)} added ({plain(cheap):.0f} s "
          f"plain), {len(apart)} written apart ({plain(apart):.0f} s plain) -> {a.out}"
          + (f"; {gone} recorded tests no longer collected, dropped" if gone else ""))


if __name__ == "__main__":
    main()
