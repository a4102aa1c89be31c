"""Helpers of the benchmark scripts that decide what a failed run reports."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import bench_hybrid_engine

# What torchrun printed when the benchmark's worker failed on an H100 (2026-11-26), shortened: the cause
# sits above torchrun's banner, whose last lines name no cause.
TORCHRUN_STDERR = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "bench/bench_hybrid_engine.py", line 62, in timed
[rank0]:     tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
[rank0]: RuntimeError: No backend type associated with device type cpu
E1126 16:10:02 torch/distributed/elastic/multiprocessing/api.py:[ERROR] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 940, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench_hybrid_engine.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1150)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_worker_is_reported_by_its_own_exception_not_torchruns_banner():
    lines = bench_hybrid_engine.failure_lines(TORCHRUN_STDERR, keep=3)
    assert lines == [
        '[rank0]:   File "bench/bench_hybrid_engine.py", line 62, in timed',
        "[rank0]:     tdist.all_reduce(x, op=tdist.ReduceOp.MAX)",
        "[rank0]: RuntimeError: No backend type associated with device type cpu",
    ]


def test_without_an_exception_line_the_end_of_stderr_is_kept():
    assert bench_hybrid_engine.failure_lines("a\nb\nc\nkilled", keep=2) == ["c", "killed"]
