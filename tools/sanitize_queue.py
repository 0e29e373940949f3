#!/usr/bin/env python3
"""compute-sanitizer over the CUDA tests from one shared queue, spread over every visible GPU.

    python3 tools/sanitize_queue.py --tool racecheck --files tests/test_*.py --deadline 480 \
        --out /tmp/out/r/sanitizer

The test ids of each file are collected once, packed into small chunks (one sanitizer process
each) with the expensive tests spread over different chunks, and handed out longest first to
--workers-per-gpu worker threads per GPU (each pinned through CUDA_VISIBLE_DEVICES). Why not one
process per file: the big files then outlast a 10-minute device call, a killed process loses the
record of what it had finished, and far more processes than GPUs starve each other.

Each test process loads this file as a pytest plugin (-p sanitize_queue) that appends one JSON
line per test (outcome, seconds) as soon as the test ends, so a chunk killed by its timeout still
tells which tests finished; the test it was running is reported unfinished and the rest of the
chunk goes back into the queue. Per-test seconds go to <out>/<tool>/costs.json: pass it back with
--costs to order the next run. <out>/<tool>/summary.json (rewritten after every chunk, so even a
run killed from outside leaves one) and summary.txt hold the result; the exit status is 1 when a
test failed, a sanitizer reported an error or a test process crashed, else 0 (tests left
unfinished by the deadline are listed, not failed).

Standard library only: it runs on the bare GPU machine.
"""
import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

# Same selection as tools/device_run.sh (why each is left out: see there).
K_DEFAULT = "not cpu and not graph and not huge and not reduce_overhead and not ddp and not second_gpu"
# Without a costs file these names mark the tests that ran longest under racecheck before.
HEAVY = ("many_shapes", "configs", "all_paths", "long", "variants")
# Guessed seconds under the sanitizer, for ordering and chunking only: a heavy test function's
# parametrizations share HEAVY_FN_S (80 cheap embedding shapes are not 80 slow attention ones),
# each between LIGHT_S and HEAVY_S; any other test LIGHT_S.
HEAVY_FN_S, HEAVY_S, LIGHT_S = 480.0, 60.0, 3.0
RECORD_ENV = "SANITIZE_QUEUE_RECORD"  # where the plugin below writes, set per chunk
LAUNCHER_ENV = "SANITIZE_QUEUE_LAUNCHER"  # the CPU tests swap compute-sanitizer for a fake
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- pytest plugin (test process)
# Loaded only inside the test processes; one line per event, flushed at once, so the record
# survives the process being killed mid-run.
_plugin_state = {}


def _record(obj):
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(obj) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _plugin_state[nodeid] = {"outcome": None, "duration": 0.0}
    _record({"id": nodeid, "event": "start", "t": time.time()})


def pytest_runtest_logreport(report):
    st = _plugin_state.setdefault(report.nodeid, {"outcome": None, "duration": 0.0})
    st["duration"] += report.duration
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        st["outcome"] = {"passed": "xpassed" if xfail else "passed", "failed": "failed",
                         "skipped": "xfailed" if xfail else "skipped"}[report.outcome]
    elif report.outcome == "failed":  # setup or teardown raised: pytest's ERROR
        st["outcome"] = "error"
    elif report.outcome == "skipped" and st["outcome"] is None:  # skipped in setup
        st["outcome"] = "skipped"


def pytest_runtest_logfinish(nodeid, location):
    st = _plugin_state.pop(nodeid, {"outcome": None, "duration": 0.0})
    _record({"id": nodeid, "event": "finish", "outcome": st["outcome"] or "error",
             "duration": round(st["duration"], 3)})


# ---------------------------------------------------------------- queue (driver process)
# How each per-test outcome counts in the summary.
BUCKET = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "error",
          "skipped": "skipped", "xfailed": "skipped"}
# "ERROR SUMMARY: 20 errors" (not the "... errors were not printed" line before it)
ERR_RE = re.compile(r"ERROR SUMMARY: (\d+) errors?\s*$", re.M)
RACE_RE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# One racecheck report, both kernels named:
#   ========= Error: Race reported between Read access at KERNEL+0xaf0
#   =========     and Write access at KERNEL+0x2f10 [20 hazards]
REPORT_RE = re.compile(r"(Error|Warning): Race reported between \w+ access at (.+?)\+0x[0-9a-fA-F]+\s*\n"
                       r"=+\s+and \w+ access at (.+?)\+0x[0-9a-fA-F]+")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", required=True, choices=["memcheck", "racecheck", "synccheck"])
    p.add_argument("--files", nargs="+", required=True, help="test files")
    p.add_argument("-k", default=K_DEFAULT, help="pytest -k expression")
    p.add_argument("--kernels", default="kns=gpu_puzzles",
                   help="compute-sanitizer --kernel-name for racecheck/synccheck; empty: every kernel "
                        "(memcheck always instruments every kernel)")
    p.add_argument("--exclude-kernels", default="",
                   help="compute-sanitizer --kernel-name-exclude for racecheck/synccheck, in every file "
                        "(kns=nvjet leaves cuBLAS's GEMMs out, but racecheck then faults at their launch "
                        "like it does filtered; --foreign-kernels is the way to set their reports apart)")
    p.add_argument("--foreign-kernels", default="",
                   help="racecheck: comma-separated kernel-name substrings (e.g. nvjet) of code that is not "
                        "ours; an error report whose two accesses both lie in such kernels is counted apart "
                        "(foreign_errors), not as a sanitizer error. Sets --print-limit 0 so none is hidden")
    p.add_argument("--unfiltered-files", nargs="*",
                   default=["tests/test_layernorm_linear.py", "tests/test_reliability.py"],
                   help="files whose racecheck/synccheck run without --kernel-name (filtered, the "
                        "tool faults inside them)")
    p.add_argument("--workers-per-gpu", type=int, default=4)
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: CUDA_VISIBLE_DEVICES if set, else nvidia-smi -L)")
    p.add_argument("--chunk", type=int, default=25, help="most test ids per sanitizer process")
    p.add_argument("--chunk-seconds", type=float, default=60.0,
                   help="aim for about this much estimated test time per process (a process start "
                        "under the sanitizer costs 10-20 s, so cheap tests share one)")
    p.add_argument("--costs", help="JSON {test_id: seconds} from a previous run (its costs.json)")
    p.add_argument("--skip", nargs="*", default=[],
                   help="summary.json files of earlier runs of the same tool on the same sources: their "
                        "clean tests (see clean_ids) are not run again, so a file too big for one call "
                        "is finished over several")
    p.add_argument("--only", help="a file of test ids, one per line (tools/sanitize_cover.py): of the "
                                  "collected tests, run only these")
    p.add_argument("--deadline", type=float, default=None, help="wall budget for the whole run, seconds")
    p.add_argument("--margin", type=float, default=None,
                   help="start no chunk when less than this is left before the deadline "
                        "(default: 60 s or a quarter of the deadline, whichever is less)")
    p.add_argument("--job-timeout", type=float, default=540.0, help="seconds per sanitizer process")
    p.add_argument("--launcher", default=os.environ.get(LAUNCHER_ENV, "compute-sanitizer"),
                   help="sanitizer command (default $%s or compute-sanitizer)" % LAUNCHER_ENV)
    p.add_argument("--python", default=sys.executable, help="interpreter for pytest")
    p.add_argument("--out", required=True, help="results go to OUT/<tool>/")
    a = p.parse_args(argv)
    if a.workers_per_gpu < 1 or a.chunk < 1:
        p.error("--workers-per-gpu and --chunk must be >= 1")
    if a.margin is None:
        a.margin = min(60.0, a.deadline / 4) if a.deadline else 60.0
    return a


def visible_gpus(n):
    """GPU ids to pin workers to: CUDA_VISIBLE_DEVICES entries if set, else 0..count-1."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        ids = [g.strip() for g in env.split(",") if g.strip()]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
            ids = [str(i) for i in range(sum(1 for line in out.splitlines() if line.startswith("GPU ")))]
        except (OSError, subprocess.SubprocessError):
            ids = []
    if n is not None:
        ids = (ids + [str(i) for i in range(len(ids), n)])[:n]
    return ids or ["0"]  # no GPU found (CPU tests): one slot, harmless there


def collect(a, f):
    """(ids, error text or None) for one file under -k."""
    cmd = [a.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", f, "-k", a.k]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return [], "collection timed out"
    ids = [line.strip() for line in p.stdout.splitlines()
           if "::" in line and not line.startswith(("ERROR", "FAILED", "=", " ", "_"))]
    # node ids are relative to pytest's rootdir: spell them with the path as given, which
    # the test processes (same working directory) can find
    ids = [f + t[t.index("::"):] for t in ids]
    if p.returncode not in (0, 5):  # 5: nothing selected
        return ids, (p.stdout + p.stderr)[-2000:]
    return ids, None


def estimates(ids, costs):
    """{id: seconds}: from costs (an earlier run) where known, else guessed from the name."""
    def fn(t):  # the test function, without its parameters
        return t.split("[")[0]

    n = {}
    for t in ids:
        n[fn(t)] = n.get(fn(t), 0) + 1
    est = {}
    for t in ids:
        if t in costs:
            est[t] = float(costs[t])
        elif any(h in fn(t).split("::")[-1] for h in HEAVY):
            est[t] = min(HEAVY_S, max(LIGHT_S, HEAVY_FN_S / n[fn(t)]))
        else:
            est[t] = LIGHT_S
    return est


def make_chunks(ids, est, chunk, chunk_seconds):
    """Split one file's ids into balanced chunks: the count follows from the estimated total and
    --chunk; ids go, most expensive first, to the chunk with the least estimated time so far, so
    the parametrizations of one heavy test land in different chunks and run in parallel."""
    m = max(1, math.ceil(sum(est.values()) / chunk_seconds), math.ceil(len(ids) / chunk))
    m = min(m, len(ids))
    bins = [[0.0, []] for _ in range(m)]
    for t in sorted(ids, key=lambda t: -est[t]):
        b = min(bins, key=lambda b: (b[0], len(b[1])))
        b[0] += est[t]
        b[1].append(t)
    return [(c, ts) for c, ts in bins if ts]


class Runner:
    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.t_end = self.t0 + a.deadline if a.deadline else None
        self.dir = os.path.join(a.out, a.tool)
        # racecheck reports to attribute to code that is not ours (--foreign-kernels)
        self.foreign = tuple(p for p in a.foreign_kernels.split(",") if p) if a.tool == "racecheck" else ()
        os.makedirs(self.dir, exist_ok=True)
        self.costs = {}
        if a.costs and os.path.exists(a.costs):
            with open(a.costs) as f:
                self.costs = json.load(f)
        self.new_costs = {}
        self.est = {}  # test id -> estimated seconds, for ordering
        self.cond = threading.Condition()
        self.queue = []  # [est_seconds, file, ids], longest first
        self.active = 0
        self.stop = False  # deadline near, or we were signalled: start nothing more
        self.files = {}  # file -> {"ids": [...], "collect_error": ...}
        self.results = {}  # test id -> {"outcome", "duration", "log"}
        self.unfinished = {}  # test id -> reason
        self.jobs = []
        self.seq = {}  # file -> next log number
        self.gpus = visible_gpus(a.gpus)

    def remaining(self):
        return math.inf if self.t_end is None else self.t_end - time.time()

    def filtered(self, f):
        norm = os.path.normpath
        return (self.a.tool != "memcheck" and bool(self.a.kernels)
                and norm(f) not in {norm(u) for u in self.a.unfiltered_files})

    def push(self, f, ids):
        est = sum(self.est[t] for t in ids)
        self.queue.append([est, f, ids])
        self.queue.sort(key=lambda j: -j[0])  # longest-processing-time first

    # ---- one chunk
    def run_job(self, f, ids, gpu):
        a = self.a
        with self.cond:
            n = self.seq[f] = self.seq.get(f, -1) + 1
        base = os.path.join(self.dir, "%s.%d" % (os.path.splitext(os.path.basename(f))[0], n))
        log, rec = base + ".log", base + ".jsonl"
        cmd = shlex.split(a.launcher) + ["--tool", a.tool]
        if self.filtered(f):
            cmd += ["--kernel-name", a.kernels]
        if a.exclude_kernels and a.tool != "memcheck":
            cmd += ["--kernel-name-exclude", a.exclude_kernels]
        # every report printed when they are attributed: one hidden past the limit could be ours
        cmd += ["--print-limit", "0" if self.foreign else "20", "--error-exitcode", "99",
                a.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "sanitize_queue"] + ids
        env = dict(os.environ)
        env[RECORD_ENV] = rec
        env["CUDA_VISIBLE_DEVICES"] = gpu  # this worker's GPU only
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # no pool: memcheck sees every tensor's bounds
        env["GPU_PUZZLES_SANITIZE"] = "1"  # the tests' smaller repeat counts (tests/conftest.py, many)
        env["GPU_PUZZLES_SANITIZE_TOOL"] = a.tool  # racecheck's lighter profile (tests/conftest.py)
        env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        # end before the deadline, leaving time for the kill and the summary
        limit = min(a.job_timeout, self.remaining() - min(10.0, a.margin / 2))
        t = time.time()
        killed = None
        with open(log, "w") as lf:
            lf.write("# gpu %s: %s\n" % (gpu, shlex.join(cmd)))
            lf.flush()
            p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            while p.poll() is None:  # poll, so a signal to the driver stops chunks at once
                if self.stop == "signal":
                    killed = "signal"
                elif time.time() - t > limit:
                    killed = "timeout" if limit >= a.job_timeout else "deadline"
                if killed:
                    kill_group(p)
                    break
                time.sleep(0.2)
            rc = p.wait()
        wall = time.time() - t
        with open(log, "a") as lf:
            lf.write("\n# exit %s after %.0f s%s\n" % (rc, wall, " (killed: %s)" % killed if killed else ""))
        self.account(f, ids, gpu, log, rec, rc, wall, killed)

    def account(self, f, ids, gpu, log, rec, rc, wall, killed):
        started, done = [], {}
        for r in read_records(rec):
            tid = match_id(r["id"], ids)
            if r["event"] == "start":
                started.append(tid)
            else:
                done[tid] = r
        with open(log, errors="replace") as fh:
            text = fh.read()
        race = RACE_RE.findall(text)
        # racecheck reports in its own summary line; take one kind only, never both twice
        errors = sum(int(e) for _, e, _ in race) if race else sum(int(m) for m in ERR_RE.findall(text))
        warnings = sum(int(w) for _, _, w in race)
        # reports inside --foreign-kernels only (both accesses): counted apart; anything the
        # parse cannot place (a tool fault, an unprinted report) stays ours
        foreign, foreign_names = 0, set()
        for kind, k1, k2 in REPORT_RE.findall(text) if self.foreign else ():
            if kind == "Error" and all(any(p in k for p in self.foreign) for k in (k1, k2)):
                foreign += 1
                foreign_names.update((k1.strip(), k2.strip()))
        foreign = min(foreign, errors)
        errors -= foreign
        if rc == 99 and errors == 0 and not foreign:  # the tool said error but its summary was lost
            errors = 1
        faults = text.count("Internal Sanitizer Error")
        # the tool's closing summary line: without it (a killed chunk) its reports may be lost
        summarized = bool(race or ERR_RE.search(text))
        missing = [t for t in ids if t not in done]
        crashed = bool(missing) and not killed
        requeue = []
        if missing:
            running = [t for t in started if t not in done]
            culprit = running[-1] if running else None
            why = {"timeout": "timeout after %.0f s" % wall, "deadline": "stopped at the deadline",
                   "signal": "stopped by a signal"}.get(killed, "process ended (exit %s) before it" % rc)
            for t in missing:
                if t == culprit or culprit is None or killed in ("deadline", "signal"):
                    self.unfinished[t] = why if t == culprit else "not run: " + why
                else:
                    requeue.append(t)  # never started: give it another process
            if culprit is not None:  # its time so far, so the next run orders it early
                self.new_costs[culprit] = round(max(wall - sum(r["duration"] for r in done.values()), 0), 1)
        with self.cond:
            for tid, r in done.items():
                self.results[tid] = {"outcome": r["outcome"], "duration": r["duration"], "log": log}
                self.unfinished.pop(tid, None)
                self.new_costs[tid] = r["duration"]
            self.jobs.append({"file": f, "log": os.path.relpath(log, self.dir), "gpu": gpu, "ids": len(ids),
                              "finished": len(done), "rc": rc, "wall_s": round(wall, 1), "killed": killed,
                              "crashed": crashed, "sanitizer_errors": errors, "sanitizer_warnings": warnings,
                              "foreign_errors": foreign, "foreign_kernels": sorted(foreign_names),
                              "tool_faults": faults, "summarized": summarized})
            if requeue:
                self.push(f, requeue)
            self.write_summary()

    # ---- workers
    def worker(self, gpu):
        while True:
            with self.cond:
                while not self.queue and self.active and not self.stop:
                    self.cond.wait(1.0)  # a running chunk may still hand ids back
                if self.stop or not self.queue:
                    return
                if self.remaining() < self.a.margin:
                    self.stop = True  # too little time to start a sanitizer process usefully
                    self.cond.notify_all()
                    return
                _, f, ids = self.queue.pop(0)
                self.active += 1
            try:
                self.run_job(f, ids, gpu)
            finally:
                with self.cond:
                    self.active -= 1
                    self.cond.notify_all()

    def on_signal(self, signum, frame):
        self.stop = "signal"  # chunks kill their processes; main writes the summary

    def run(self):
        a = self.a
        # collection imports torch once per file: do the files in parallel
        coll = {}
        ts = [threading.Thread(target=lambda f=f: coll.__setitem__(f, collect(a, f))) for f in a.files]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        done = set()
        for path in a.skip:
            if os.path.exists(path):
                done |= clean_ids(path, a.tool)
            else:  # e.g. an unmatched glob: nothing to skip from it
                print("--skip %s: no such file, ignored" % path, flush=True)
        only = None
        if a.only:
            with open(a.only) as fh:
                only = {line.strip() for line in fh if line.strip()}
        for f in a.files:
            ids, err = coll[f]
            if only is not None:  # same id, however the rootdir spells it
                ids = [t for t in ids if match_id(t, only) in only]
            before = {t for t in ids if match_id(t, done) in done}  # same id, however the rootdir spells it
            ids = [t for t in ids if t not in before]  # what this run selects
            self.files[f] = {"ids": ids, "collect_error": err, "done_before": len(before)}
            self.est.update(estimates(ids, self.costs))
            for _, chunk in make_chunks(ids, self.est, a.chunk, a.chunk_seconds) if ids else []:
                self.push(f, chunk)
        self.write_summary()
        workers = [threading.Thread(target=self.worker, args=(self.gpus[i % len(self.gpus)],), daemon=True)
                   for i in range(len(self.gpus) * a.workers_per_gpu)]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(0.5)  # short joins keep the main thread able to take a signal
        with self.cond:
            for _, _, ids in self.queue:
                for t in ids:
                    self.unfinished.setdefault(t, "never started (deadline)")
            self.queue = []
            return self.write_summary()

    # ---- summary
    def write_summary(self):
        files, ok = {}, True
        for f, info in self.files.items():
            ids = info["ids"]
            c = {"selected": len(ids), "done_before": info["done_before"], "passed": 0, "failed": 0,
                 "error": 0, "skipped": 0}
            for t in ids:
                if t in self.results:
                    c[BUCKET.get(self.results[t]["outcome"], "error")] += 1
            jobs = [j for j in self.jobs if j["file"] == f]
            unf = {t: self.unfinished.get(t, "queued") for t in ids if t not in self.results}
            c.update(unfinished=len(unf), filtered=self.filtered(f),
                     sanitizer_errors=sum(j["sanitizer_errors"] for j in jobs),
                     sanitizer_warnings=sum(j["sanitizer_warnings"] for j in jobs),
                     foreign_errors=sum(j.get("foreign_errors", 0) for j in jobs),
                     foreign_kernels=sorted({k for j in jobs for k in j.get("foreign_kernels", ())}),
                     tool_faults=sum(j["tool_faults"] for j in jobs),
                     crashed_chunks=sum(j["crashed"] for j in jobs),
                     logs_with_errors=[j["log"] for j in jobs if j["sanitizer_errors"]],
                     failed_ids=[t for t in ids if t in self.results
                                 and BUCKET.get(self.results[t]["outcome"]) in ("failed", "error")],
                     unfinished_ids=unf, collect_error=info["collect_error"])
            ok &= not (c["failed"] or c["error"] or c["sanitizer_errors"] or c["crashed_chunks"]
                       or c["collect_error"])
            files[f] = c
        s = {"tool": self.a.tool, "k": self.a.k, "kernels": self.a.kernels if self.a.tool != "memcheck" else "",
             "exclude_kernels": self.a.exclude_kernels if self.a.tool != "memcheck" else "",
             "foreign_kernels": list(self.foreign),
             "gpus": self.gpus, "workers_per_gpu": self.a.workers_per_gpu, "deadline_s": self.a.deadline,
             "only": self.a.only, "wall_s": round(time.time() - self.t0, 1), "ok": ok, "files": files,
             "jobs": self.jobs}
        atomic_json(os.path.join(self.dir, "summary.json"), s)
        costs = dict(self.costs, **self.new_costs)
        atomic_json(os.path.join(self.dir, "costs.json"), dict(sorted(costs.items())))
        return s


def clean_ids(summary_path, tool):
    """Test ids an earlier run (its summary.json, with the chunks' .jsonl records beside it) ran
    cleanly: passed or skipped, in a chunk of the same tool that ended with the tool's own summary
    line (not killed before it), reported no sanitizer error and no tool fault. Anything else runs
    again."""
    with open(summary_path) as f:
        s = json.load(f)
    if s.get("tool") != tool:
        raise SystemExit("--skip %s: a %s run, not %s" % (summary_path, s.get("tool"), tool))
    d = os.path.dirname(os.path.abspath(summary_path))
    # Clean tests are read from the chunks' .jsonl records, not from summary.json: a summary
    # copied without them would silently skip nothing and the whole run would be repeated. (One
    # record may be missing where a process died before its first test: that chunk counts nothing.)
    records = [os.path.join(d, os.path.splitext(j["log"])[0] + ".jsonl") for j in s["jobs"]]
    if records and not any(os.path.exists(r) for r in records):
        raise SystemExit("--skip %s: none of its %d chunk records (%s, ...) is beside it; copy the whole "
                         "%s/ folder" % (summary_path, len(records), os.path.basename(records[0]), tool))
    out = set()
    for j, rec in zip(s["jobs"], records):
        if j["sanitizer_errors"] or j["tool_faults"] or j["crashed"] or not j.get("summarized", not j["killed"]):
            continue
        for r in read_records(rec):
            if r.get("event") == "finish" and BUCKET.get(r.get("outcome")) in ("passed", "skipped"):
                out.add(r["id"])
    return out


def read_records(path):
    """The plugin's per-test events of one chunk (none if the file is missing); a line cut by a
    kill is skipped."""
    if not os.path.exists(path):
        return
    with open(path) as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def match_id(rid, ids):
    """The chunk's id for a node id the plugin reported (the same unless rootdirs differ)."""
    if rid in ids:
        return rid
    for t in ids:
        if t.endswith(rid) or rid.endswith(t):
            return t
    return rid


def kill_group(p):
    """compute-sanitizer starts the python process as its child: end the whole group."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def atomic_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


UNFINISHED_SHOWN = 15  # per file in the printed summary; summary.json lists them all


def human(s):
    lines = ["%s: %d GPU(s) x %d workers, %d processes, %.0f s%s, kernels: %s%s" % (
        s["tool"], len(s["gpus"]), s["workers_per_gpu"], len(s["jobs"]), s["wall_s"],
        " (deadline %.0f s)" % s["deadline_s"] if s["deadline_s"] else "", s["kernels"] or "all",
        ", excluded: %s" % s["exclude_kernels"] if s.get("exclude_kernels") else "")]
    if s.get("only"):
        lines.append("tests: those listed in %s" % s["only"])
    hdr = "%-26s %8s %6s %6s %5s %7s %10s %10s"
    lines.append(hdr % ("file", "selected", "passed", "failed", "error", "skipped", "unfinished", "san.errors"))
    for f, c in s["files"].items():
        name = os.path.splitext(os.path.basename(f))[0] + ("" if c["filtered"] or s["tool"] == "memcheck"
                                                          or not s["kernels"] else " (unfilt.)")
        lines.append(hdr % (name, c["selected"], c["passed"], c["failed"], c["error"], c["skipped"],
                            c["unfinished"], c["sanitizer_errors"]))
        if c["done_before"]:
            lines.append("    clean in the --skip runs, not run again: %d" % c["done_before"])
        if c["collect_error"]:
            lines.append("    collection failed: " + c["collect_error"].strip().splitlines()[-1])
        for key, label in (("sanitizer_warnings", "racecheck warnings"), ("tool_faults", "internal sanitizer errors"),
                           ("crashed_chunks", "processes that ended before their tests")):
            if c[key]:
                lines.append("    %s: %d" % (label, c[key]))
        if c.get("foreign_errors"):
            lines.append("    reports inside foreign kernels only (not counted): %d, in %s"
                         % (c["foreign_errors"], ", ".join(c["foreign_kernels"])))
        if c["logs_with_errors"]:
            lines.append("    logs with sanitizer errors: " + " ".join(c["logs_with_errors"]))
        for t in c["failed_ids"]:
            lines.append("    failed: " + t)
        unf = list(c["unfinished_ids"].items())
        for t, why in unf[:UNFINISHED_SHOWN]:
            lines.append("    unfinished: %s (%s)" % (t, why))
        if len(unf) > UNFINISHED_SHOWN:
            lines.append("    ... %d more unfinished: see summary.json" % (len(unf) - UNFINISHED_SHOWN))
    lines.append("result: %s" % ("OK" if s["ok"] else "PROBLEMS (failed tests, sanitizer errors or crashes)"))
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    r = Runner(a)
    signal.signal(signal.SIGTERM, r.on_signal)  # e.g. an outer `timeout`: still write the summary
    signal.signal(signal.SIGINT, r.on_signal)
    s = r.run()
    text = human(s)
    with open(os.path.join(r.dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
