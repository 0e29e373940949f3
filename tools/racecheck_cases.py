"""Choose the cases racecheck runs: per test, a few cases that together make every kernel
launch (kernel, block size, shared memory) that all of the test's cases make.

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


def choose(cases):
    """cases: {case: set of launches}. The greedy cover, in the order chosen."""
    need = set().union(*cases.values()) if cases else set()
    chosen = []
    while need:
        best = max(cases, key=lambda c: len(cases[c] & need))
        chosen.append(best)
        need -= cases[best]
    return chosen


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", help="JSON lines written under GPU_PUZZLES_RECORD_LAUNCHES")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tests = collections.defaultdict(lambda: collections.defaultdict(set))
    for line in open(a.record):
        r = json.loads(line)
        tests[r["test"]][r["case"]] |= {tuple(x) for x in r["launches"]}
    out, n_all, n_chosen, n_launch = {}, 0, 0, 0
    for test, cases in sorted(tests.items()):
        out[test] = sorted(choose(cases))
        n_all += len(cases)
        n_chosen += len(out[test])
        n_launch += len(set().union(*cases.values()))
    summary = (f"{len(out)} tests: {n_chosen} of {n_all} cases make all {n_launch} distinct launches "
               "(kernel, block, shared memory) of their test")
    json.dump({"made_by": "tools/racecheck_cases.py", "summary": summary, "cases": out}, open(a.out, "w"), indent=1)
    print(summary)


if __name__ == "__main__":
    main()
