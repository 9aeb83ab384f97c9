"""What the tests and the benchmarks both use (as ``accelerate.test_utils`` and ``transformers.testing_utils``
ship theirs): the objective-vs-fp32 precision cases (:mod:`~mmpretrain.testing.precision`, run by
tests/test_precision.py on the CPU and by scripts/bench/gpu_bench.py on a GPU) and clip_benchmark run on
the same model and data (:mod:`~mmpretrain.testing.clip_benchmark_anchor`, tests/test_eval.py and
scripts/bench/bench_eval.py). Nothing in the library imports this package; clip_benchmark is a dev
dependency, imported where it is used."""
