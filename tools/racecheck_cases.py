"""Choose the cases racecheck runs: a few cases of the recorded tests that together make
every kernel launch (kernel, block size, shared memory) that all of their cases make. The
cover is over all recorded tests at once (the knob variants share most kernels), so a
recorded test may keep no case at all.

Record the launches of the racecheck profile's cases on a GPU (plain run, no sanitizer:
GPU_PUZZLES_SANITIZE=1 and GPU_PUZZLES_SANITIZE_TOOL=racecheck only select the profile),
then pick the cases greedily (the case adding most new launches first) and write
tests/racecheck_cases.json, which tests/conftest.py reads under racecheck:

    GPU_PUZZLES_SANITIZE=1 GPU_PUZZLES_SANITIZE_TOOL=racecheck GPU_PUZZLES_RECORD_LAUNCHES=rec.jsonl \\
        python -m pytest tests/test_softmax.py -k variants
    python tools/racecheck_cases.py rec.jsonl --out tests/racecheck_cases.json
"""
import argparse
import collections
import json


def choose(cases, cost=None):
    """cases: {key: set of launches}; cost: {key: seconds}, or None for equal costs. The greedy
    cover, in the order chosen: each step takes the key adding the most new launches per cost."""
    need = set().union(*cases.values()) if cases else set()
    chosen = []
    while need:
        best = max(cases, key=lambda c: len(cases[c] & need) / (cost[c] if cost else 1.0))
        chosen.append(best)
        need -= cases[best]
    return chosen


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", help="JSON lines written under GPU_PUZZLES_RECORD_LAUNCHES")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cases = collections.defaultdict(set)
    for line in open(a.record):
        r = json.loads(line)
        cases[(r["test"], r["case"])] |= {tuple(x) for x in r["launches"]}
    out = {test: [] for test, _ in cases}
    for test, case in choose(cases):
        out[test].append(case)
    out = {t: sorted(c) for t, c in sorted(out.items())}
    launches = set().union(*cases.values()) if cases else set()
    summary = (f"{len(out)} tests, {len(cases)} cases: {sum(map(len, out.values()))} cases make all "
               f"{len(launches)} distinct launches (kernel, block, shared memory) of them")
    json.dump({"made_by": "tools/racecheck_cases.py", "summary": summary, "cases": out}, open(a.out, "w"), indent=1)
    print(summary)


if __name__ == "__main__":
    main()
