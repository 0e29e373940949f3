"""tools/sanitize_queue.py (and device_run.sh --stamp) on the CPU: a fake sanitizer (drops the tool's options, runs the
test command, prints an ERROR SUMMARY) over a throwaway test file with a passing, a failing and a
hanging test. Every test name says "cpu" so the sanitizer runs themselves (-k "not cpu") skip them."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/tests/ -> the repo
SCRIPT = os.path.join(ROOT, "tools", "sanitize_queue.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import sanitize_queue  # noqa: E402


def _own_env():
    """This process's environment without the caller's sanitizer settings (SANITIZE_K,
    SANITIZE_SKIP, PYTEST_ADDOPTS, ...), which would select other tests in the fake runs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SANITIZE_") and k != "PYTEST_ADDOPTS"}

FAKE = """
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):  # compute-sanitizer's options, each with a value
    args = args[2:]
print("fake sanitizer on GPU", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
rc = subprocess.call(args)
n = int(os.environ.get("FAKE_ERRORS", "0"))
if os.environ.get("FAKE_RACE"):  # racecheck's reports and its own summary line, with warnings
    f = int(os.environ.get("FAKE_FOREIGN", "0"))  # reports inside cuBLAS-like kernels
    for k in ["nvjet_sm90_tst_splitK_NTN"] * f + ["void gpu_puzzles::k<float>(int)"] * n:
        print("========= Error: Race reported between Read access at %s+0xaf0" % k)
        print("=========     and Write access at %s+0x2f10 [20 hazards]" % k)
        print("========= ")
    print("========= RACECHECK SUMMARY: %d hazards displayed (%d errors, 2 warnings)" % (n + f + 2, n + f), flush=True)
    n += f
else:
    if n > 1:  # past --print-limit the tool prints this line first (once the limit was 1)
        print("========= ERROR SUMMARY: %d errors were not printed. Use --print-limit" % (n - 1), flush=True)
    print("========= ERROR SUMMARY: %d error%s" % (n, "" if n == 1 else "s"), flush=True)
sys.exit(99 if n and rc == 0 else rc)
"""

TESTS = """
import time
def test_ok():
    pass
def test_bad():
    assert 1 == 2
def test_long_sleep():  # "long": ordered first, and alone past the job timeout
    time.sleep(60)
def test_cpu_only():  # deselected by the default -k
    pass
"""


def run_queue(tmp_path, *args, errors=0, race=False, foreign=0):
    (tmp_path / "fake_sanitizer.py").write_text(textwrap.dedent(FAKE))
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(TESTS))
    env = dict(_own_env(), FAKE_ERRORS=str(errors), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               SANITIZE_QUEUE_LAUNCHER="%s %s" % (sys.executable, tmp_path / "fake_sanitizer.py"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if race:
        env["FAKE_RACE"] = "1"
    env["FAKE_FOREIGN"] = str(foreign)
    p = subprocess.run([sys.executable, SCRIPT, "--tool", "racecheck", "--files", "test_tiny.py",
                        "--out", "out", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    summary = json.loads((tmp_path / "out" / "racecheck" / "summary.json").read_text())
    return p, summary, summary["files"]["test_tiny.py"]


def test_cpu_timeout_requeues_rest_and_failure_fails(tmp_path):
    # one chunk, the hanging test first: it times out, the two behind it get a new process
    p, s, c = run_queue(tmp_path, "--gpus", "2", "--chunk-seconds", "1000", "--job-timeout", "3")
    assert p.returncode == 1, p.stdout + p.stderr
    assert (c["selected"], c["passed"], c["failed"], c["error"], c["skipped"]) == (3, 1, 1, 0, 0)
    assert c["unfinished"] == 1 and list(c["unfinished_ids"]) == ["test_tiny.py::test_long_sleep"]
    assert c["unfinished_ids"]["test_tiny.py::test_long_sleep"].startswith("timeout")
    assert c["failed_ids"] == ["test_tiny.py::test_bad"]
    assert c["sanitizer_errors"] == 0 and c["crashed_chunks"] == 0 and not s["ok"]
    assert [j["killed"] for j in s["jobs"]] == ["timeout", None]
    assert {j["gpu"] for j in s["jobs"]} <= {"0", "1"}
    assert c["filtered"] and s["kernels"] == "kns=gpu_puzzles"
    log = (tmp_path / "out" / "racecheck" / s["jobs"][0]["log"]).read_text()
    assert "--kernel-name kns=gpu_puzzles" in log and "fake sanitizer on GPU" in log
    costs = json.loads((tmp_path / "out" / "racecheck" / "costs.json").read_text())
    assert set(costs) == {"test_tiny.py::test_ok", "test_tiny.py::test_bad", "test_tiny.py::test_long_sleep"}
    assert costs["test_tiny.py::test_long_sleep"] >= 2
    assert "unfinished: test_tiny.py::test_long_sleep (timeout" in p.stdout


@pytest.mark.parametrize("ours", [0, 1])
def test_cpu_foreign_kernel_reports_counted_apart(tmp_path, ours):
    # three reports inside nvjet kernels: not errors; one in our kernel beside them still is
    p, s, c = run_queue(tmp_path, "-k", "ok", "--kernels", "", "--foreign-kernels", "nvjet,cutlass",
                        errors=ours, race=True, foreign=3)
    assert p.returncode == ours, p.stdout + p.stderr
    assert (c["sanitizer_errors"], c["foreign_errors"]) == (ours, 3)
    assert c["foreign_kernels"] == ["nvjet_sm90_tst_splitK_NTN"] and s["ok"] == (not ours)
    log = (tmp_path / "out" / "racecheck" / s["jobs"][0]["log"]).read_text()
    assert "--print-limit 0" in log  # none hidden past a limit
    assert "reports inside foreign kernels only (not counted): 3" in p.stdout
    clean = sanitize_queue.clean_ids(str(tmp_path / "out" / "racecheck" / "summary.json"), "racecheck")
    assert clean == (set() if ours else {"test_tiny.py::test_ok"})


def test_cpu_exclude_kernels_reaches_the_sanitizer(tmp_path):
    # unfiltered (no --kernel-name) yet cuBLAS's kernels left out: both show in the command and summary
    p, s, c = run_queue(tmp_path, "-k", "ok", "--kernels", "", "--exclude-kernels", "kns=nvjet")
    assert p.returncode == 0, p.stdout + p.stderr
    log = (tmp_path / "out" / "racecheck" / s["jobs"][0]["log"]).read_text()
    assert "--kernel-name-exclude kns=nvjet" in log and "--kernel-name " not in log
    assert s["exclude_kernels"] == "kns=nvjet" and "excluded: kns=nvjet" in p.stdout


@pytest.mark.parametrize("errors,race", [(0, False), (1, False), (25, False), (1, True)])
def test_cpu_sanitizer_errors_set_exit_code(tmp_path, errors, race):
    p, s, c = run_queue(tmp_path, "-k", "ok", "--kernels", "", errors=errors, race=race)
    assert p.returncode == min(errors, 1), p.stdout + p.stderr
    assert (c["selected"], c["passed"], c["unfinished"], c["sanitizer_errors"]) == (1, 1, 0, errors)
    assert c["sanitizer_warnings"] == (2 if race else 0)  # warnings alone fail nothing
    assert s["ok"] == (not errors) and not c["filtered"]
    assert c["logs_with_errors"] == (["test_tiny.0.log"] if errors else [])


def test_cpu_deadline_stops_and_still_writes_summary(tmp_path):
    p, s, c = run_queue(tmp_path, "--chunk-seconds", "1000", "--deadline", "5", "--margin", "2")
    assert p.returncode == 0, p.stdout + p.stderr  # unfinished is reported, not failed
    assert c["unfinished"] == 3 and s["wall_s"] < 8
    assert c["unfinished_ids"]["test_tiny.py::test_long_sleep"] == "stopped at the deadline"
    assert c["unfinished_ids"]["test_tiny.py::test_ok"].startswith("not run")


@pytest.mark.parametrize("errors", [0, 1])
def test_cpu_skip_reruns_only_what_was_not_clean(tmp_path, errors):
    # A first run: test_ok passes, test_bad fails; the second run, given the first's summary,
    # runs again everything but the clean pass (and, if the tool reported errors, that too).
    run_queue(tmp_path, "-k", "ok or bad", "--kernels", "", errors=errors)
    first = tmp_path / "first"
    (tmp_path / "out").rename(first)
    assert sanitize_queue.clean_ids(str(first / "racecheck" / "summary.json"), "racecheck") == (
        set() if errors else {"test_tiny.py::test_ok"})
    with pytest.raises(SystemExit, match="not memcheck"):
        sanitize_queue.clean_ids(str(first / "racecheck" / "summary.json"), "memcheck")
    alone = tmp_path / "alone"  # summary.json copied without its records: refused, not "nothing clean"
    alone.mkdir()
    shutil.copy(first / "racecheck" / "summary.json", alone / "summary.json")
    with pytest.raises(SystemExit, match="none of its .* chunk records"):
        sanitize_queue.clean_ids(str(alone / "summary.json"), "racecheck")
    p, s, c = run_queue(tmp_path, "-k", "ok or bad", "--kernels", "", "--skip",
                        str(first / "racecheck" / "summary.json"))
    assert (c["done_before"], c["selected"], c["failed"]) == ((0, 2, 1) if errors else (1, 1, 1))
    assert c["passed"] == (1 if errors else 0)
    assert ("clean in the --skip runs, not run again: 1" in p.stdout) == (not errors)


def run_device_run(tmp_path, files, timeout=120, **env):
    """tools/device_run.sh (with the tools it calls) in tmp_path over the test files {name: source},
    the fake sanitizer in place of compute-sanitizer; env: its knobs (STEPS, SANITIZE_*, ...)."""
    (tmp_path / "tools").mkdir()
    for f in ("device_run.sh", "sanitize_queue.py", "sanitize_cover.py", "racecheck_cases.py"):
        shutil.copy(os.path.join(ROOT, "tools", f), tmp_path / "tools" / f)
    (tmp_path / "fake_sanitizer.py").write_text(textwrap.dedent(FAKE))
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    bindir = os.path.dirname(sys.executable)
    env = dict(_own_env(), PATH=bindir + os.pathsep + os.environ["PATH"], OUT=str(tmp_path / "out"),
               SANITIZE_QUEUE_LAUNCHER="%s %s" % (sys.executable, tmp_path / "fake_sanitizer.py"), **env)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if not shutil.which("python3", path=env["PATH"]):
        pytest.skip("no python3 on PATH")
    return subprocess.run(["bash", "tools/device_run.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cpu_device_run_per_tool_files(tmp_path):
    # device_run.sh STEPS=memcheck+racecheck with SANITIZE_FILES_<tool> / SANITIZE_WORKERS_<tool>:
    # each tool runs its own files with its own process count, in one call (fake sanitizer).
    p = run_device_run(tmp_path, {"test_one.py": "def test_a():\n    pass\n",
                                  "test_two.py": "def test_b():\n    pass\ndef test_c():\n    pass\n"},
                       STEPS="memcheck+racecheck", SANITIZE_FILES_memcheck="test_one.py",
                       SANITIZE_FILES_racecheck="test_two.py", SANITIZE_WORKERS="4", SANITIZE_WORKERS_racecheck="3",
                       SANITIZE_TIMEOUT="60", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    out = tmp_path / "out" / "r" / "sanitizer"
    mem = json.loads((out / "memcheck" / "summary.json").read_text())
    race = json.loads((out / "racecheck" / "summary.json").read_text())
    assert list(mem["files"]) == ["test_one.py"] and list(race["files"]) == ["test_two.py"], p.stdout + p.stderr
    assert mem["files"]["test_one.py"]["passed"] == 1 and race["files"]["test_two.py"]["passed"] == 2
    assert mem["workers_per_gpu"] == 2 and race["workers_per_gpu"] == 3  # 4 split over two steps; set apart


def test_cpu_chunks_spread_heavy_ids():
    sq = sanitize_queue
    ids = ["f.py::test_many_shapes[%d]" % i for i in range(4)] + ["f.py::test_small[%d]" % i for i in range(8)]
    est = sq.estimates(ids, {})
    assert est[ids[0]] == sq.HEAVY_S and est[ids[-1]] == sq.LIGHT_S
    chunks = sq.make_chunks(ids, est, chunk=25, chunk_seconds=60)
    assert len(chunks) == 5  # 4 x 60 s + 8 x 3 s
    assert all(sum("many_shapes" in t for t in ts) <= 1 for _, ts in chunks)
    assert sorted(t for _, ts in chunks for t in ts) == sorted(ids)
    # many parametrizations of a heavy function share its guess
    many = ["f.py::test_many_shapes[%d]" % i for i in range(80)]
    assert sq.estimates(many, {})[many[0]] == sq.HEAVY_FN_S / 80
    # known costs override the names; --chunk caps the ids per process
    cheap = sq.estimates(ids, {t: 0.1 for t in ids})
    assert len(sq.make_chunks(ids, cheap, chunk=5, chunk_seconds=60)) == 3


def test_cpu_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert sanitize_queue.visible_gpus(None) == ["2", "3"]
    assert sanitize_queue.visible_gpus(1) == ["2"]


def test_prebuilt_stamp_cpu(tmp_path):
    # tools/device_run.sh --stamp: what a carried .prebuilt/ must match (python, torch, sources);
    # a changed source changes it, so a stale .so is rebuilt rather than run.
    import torch

    def stamp(root):
        out = subprocess.run(["bash", os.path.join(ROOT, "tools", "device_run.sh"), "--stamp", sys.executable],
                             cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        return out

    here = stamp(ROOT)
    py = "%d.%d" % sys.version_info[:2]
    assert here.startswith(f"py={py} torch={torch.__version__} src="), here
    src = here.rsplit("src=", 1)[1]
    assert len(src) == 16 and all(c in "0123456789abcdef" for c in src), here
    # A copy of the sources with one byte changed stamps differently; an exact copy the same.
    (tmp_path / "csrc").mkdir()
    for d, _, files in os.walk(os.path.join(ROOT, "csrc")):
        rel = os.path.relpath(d, ROOT)
        os.makedirs(tmp_path / rel, exist_ok=True)
        for f in files:
            with open(os.path.join(d, f), "rb") as a, open(tmp_path / rel / f, "wb") as b:
                b.write(a.read())
    with open(os.path.join(ROOT, "setup.py"), "rb") as a, open(tmp_path / "setup.py", "wb") as b:
        b.write(a.read())
    assert stamp(tmp_path) == here
    with open(tmp_path / "setup.py", "ab") as b:
        b.write(b"\n# changed\n")
    assert stamp(tmp_path) != here


def test_cpu_only_list_selects_those_tests(tmp_path):
    (tmp_path / "cover.txt").write_text("test_tiny.py::test_ok\ntest_tiny.py::test_not_collected\n")
    p, s, c = run_queue(tmp_path, "--only", "cover.txt")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (c["selected"], c["passed"], c["unfinished"]) == (1, 1, 0)
    assert s["only"] == "cover.txt" and "tests: those listed in cover.txt" in p.stdout


def test_cpu_cover_takes_every_launch_cheapest_first(tmp_path):
    import sanitize_cover
    records = [
        {"test": "t::big", "seconds": 50.0, "launches": [["k1", "[128]", 0], ["k2", "[128]", 0], ["k3", "[64]", 0]]},
        {"test": "t::a", "seconds": 0.5, "launches": [["k1", "[128]", 0], ["k2", "[128]", 0]]},
        {"test": "t::b", "seconds": 0.5, "launches": [["k3", "[64]", 0]]},
        {"test": "t::same", "seconds": 0.1, "launches": [["k1", "[128]", 0]]},
        {"test": "t::none", "seconds": 0.1, "launches": []},
        {"test": "t::own_profiler", "seconds": 2.0, "launches": None},
    ]
    chosen, unrecorded, n = sanitize_cover.cover(records)
    assert n == 3 and sorted(chosen) == ["t::a", "t::b"] and unrecorded == ["t::own_profiler"]
    # the same launch with another block size is another launch
    records.append({"test": "t::c", "seconds": 9.0, "launches": [["k3", "[32]", 0]]})
    chosen, _, n = sanitize_cover.cover(records)
    assert n == 4 and sorted(chosen) == ["t::a", "t::b", "t::c"]
    rec = tmp_path / "rec.jsonl"
    rec.write_text("".join(json.dumps(r) + "\n" for r in records))
    sanitize_cover.main([str(rec), "--out", str(tmp_path / "cover.txt")])
    assert (tmp_path / "cover.txt").read_text().split() == chosen + ["t::own_profiler"]
    # an unrecorded test past --unrecorded-max-s is written apart, not run with the cover
    sanitize_cover.main([str(rec), "--out", str(tmp_path / "cover.txt"), "--unrecorded-max-s", "1"])
    assert (tmp_path / "cover.txt").read_text().split() == chosen
    assert (tmp_path / "cover.txt.unrecorded").read_text().split() == ["t::own_profiler"]
    # a test the suite no longer collects (renamed since the record) is not chosen
    (tmp_path / "now.txt").write_text("t::a\nt::b\nt::own_profiler\n")
    sanitize_cover.main([str(rec), "--out", str(tmp_path / "cover.txt"), "--collected", str(tmp_path / "now.txt")])
    assert sorted((tmp_path / "cover.txt").read_text().split()) == ["t::a", "t::b", "t::own_profiler"]


def test_cpu_record_then_finish_a_cut_record(tmp_path):
    # tests/conftest.py: GPU_PUZZLES_RECORD_TEST_LAUNCHES appends a line per test; a second call given
    # that record in GPU_PUZZLES_RECORD_SKIP runs only the tests it lacks (here: none of the first two)
    rec, rec2 = tmp_path / "rec.jsonl", tmp_path / "rec2.jsonl"
    env = dict(_own_env(), PYTHONPATH=ROOT, GPU_PUZZLES_RECORD_TEST_LAUNCHES=str(rec))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conv1d.py", "-k", "seed_example"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    first = [json.loads(line) for line in rec.read_text().splitlines()]
    assert len(first) >= 2 and all(r["launches"] == [] and r["seconds"] >= 0 for r in first)  # no GPU: no kernels
    ids = {r["test"] for r in first}
    env.update(GPU_PUZZLES_RECORD_TEST_LAUNCHES=str(rec2), GPU_PUZZLES_RECORD_SKIP=str(rec))
    p = subprocess.run(cmd[:-1] + ["seed_example or bad_input"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    second = {json.loads(line)["test"] for line in rec2.read_text().splitlines()}
    assert second and not (second & ids)
    listed = subprocess.run(cmd[:-1] + ["seed_example or bad_input", "--collect-only"], cwd=ROOT,
                            env=dict(_own_env(), PYTHONPATH=ROOT),
                            capture_output=True, text=True, timeout=300).stdout
    assert second | ids == {line.strip() for line in listed.splitlines() if "::" in line}



def test_cpu_record_a_test_with_its_own_profiler(tmp_path):
    # the recorder pauses for a test's own profiler (here conftest.fill_ops) and reads the launches
    # from it: the test passes as it would unrecorded and its line is a list, not null; a record
    # whose line for a test is null does not deselect it in the next call
    rec, rec2 = tmp_path / "rec.jsonl", tmp_path / "rec2.jsonl"
    test = "tests/test_cross_entropy.py::test_backward_adds_no_fill_for_extra_outputs[cpu]"
    env = dict(_own_env(), PYTHONPATH=ROOT, GPU_PUZZLES_RECORD_TEST_LAUNCHES=str(rec))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert [json.loads(line)["launches"] for line in rec.read_text().splitlines()] == [[]]
    rec.write_text(json.dumps({"test": test, "seconds": 1.0, "launches": None}) + "\n")
    env.update(GPU_PUZZLES_RECORD_TEST_LAUNCHES=str(rec2), GPU_PUZZLES_RECORD_SKIP=str(rec))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert [json.loads(line)["test"] for line in rec2.read_text().splitlines()] == [test]

def test_cpu_record_a_test_that_exports_its_own_trace(tmp_path):
    # a test's own profiler whose trace the test exports (conftest.copy_kernels does): the recorder
    # reads that trace too, and a trace saves only once, so the test's export must still work
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_trace.py").write_text(textwrap.dedent("""
        import gzip, json, pytest, torch
        @pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
        def test_cpu_exports(tmp_path, name):
            from torch.profiler import ProfilerActivity, profile  # as copy_kernels: the recorder's wrapper
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                torch.ones(4).add_(1)
            prof.export_chrome_trace(str(tmp_path / name))
            trace = (gzip.open if name.endswith(".gz") else open)(tmp_path / name)
            assert any(e.get("name") == "aten::add_" for e in json.load(trace)["traceEvents"])
        """))
    rec = tmp_path / "rec.jsonl"
    env = dict(_own_env(), PYTHONPATH=ROOT, GPU_PUZZLES_RECORD_TEST_LAUNCHES=str(rec))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_trace.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert [json.loads(line)["launches"] for line in rec.read_text().splitlines()] == [[], []]


RECORDING_CONFTEST = """
import json, os, time, pytest
LAUNCH = {"test_a": "k1", "test_b": "k1", "test_c": "k2", "test_slow": "k3"}

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    path = os.environ.get("GPU_PUZZLES_RECORD_TEST_LAUNCHES")
    if path:  # a stand-in for tests/conftest.py's recorder: one launch per test
        with open(path, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "seconds": 0.1,
                                "launches": [[LAUNCH[item.name], "[128]", 0]]}) + "\\n")
"""


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
def test_cpu_device_run_record_then_sanitize_the_cover(tmp_path, cut):
    # STEPS="record memcheck": the record step's cover (test_a and test_b make the same launch) is
    # the list memcheck runs; a record cut by TESTS_TIMEOUT says so, and its cover lacks what it missed.
    slow = "import time\ndef test_slow():\n    time.sleep(30)\n" if cut else ""
    tests = "def test_a():\n    pass\ndef test_b():\n    pass\ndef test_c():\n    pass\n" + slow
    # plugins load (no PYTEST_DISABLE_PLUGIN_AUTOLOAD): the record step passes -n where xdist is there
    p = run_device_run(tmp_path, {"conftest.py": RECORDING_CONFTEST, "test_one.py": tests}, timeout=180,
                       STEPS="record memcheck", SANITIZE_FILES="test_one.py", TESTS_TIMEOUT="8" if cut else "60",
                       SANITIZE_TIMEOUT="60", TEST_WORKERS="1")
    cover = (tmp_path / "out" / "r" / "cover.txt").read_text().split()
    assert len(cover) == 2 and "test_one.py::test_c" in cover, p.stdout + p.stderr
    mem = json.loads((tmp_path / "out" / "r" / "sanitizer" / "memcheck" / "summary.json").read_text())
    assert mem["only"].endswith("cover.txt") and mem["files"]["test_one.py"]["passed"] == 2
    assert ("RECORD INCOMPLETE" in p.stdout) == cut
