"""Benchmarks: ``python -m gpu_puzzles.bench OP [OP ...] --json FILE``.

Each op has a module here exposing ``bench_cases(device)`` (the benchmark shapes),
``tour_cases(device)`` (small cases for ``python -m gpu_puzzles``) and
``tour_check(device)`` (max errors against a float64 reference).
"""
import importlib

OPS = ["conv1d", "embedding", "softmax", "layernorm_linear", "attention", "rmsnorm_linear", "cross_entropy",
       "gated_act", "rotary"]


def op_module(name):
    return importlib.import_module(f"gpu_puzzles.bench.{name}")
