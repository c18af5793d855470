"""Benchmarks with llama-bench's tests, fields and table layout, plus per-shape kernel timings.

`python scripts/bench.py` (or `python -m minfer_bench.bench`; `cli.main`) has two modes:

Model mode (the default) mirrors llama.cpp's tools/llama-bench/llama-bench.cpp:
  ppN      prefill of N tokens into an empty cache; t/s = N / time
  tgN      N single-token decode steps from an empty cache (the first token at position 0);
           t/s = N / time
  ppN+tgM  (-pg N,M) prefill N, then decode M, timed together; t/s = (N + M) / time
  Each test runs once untimed (warm-up; --no-warmup skips it), then -r times; a row reports
  avg +- sample stdev of the per-run t/s (llama-bench's avg_ts / stddev_ts) and of the run
  times in ns (avg_ns / stddev_ns). csv/json/jsonl carry every llama-bench field under its
  name (test::get_fields()), then minfer_jax's own columns. Timing: model_tests.

Kernel mode (--kernels, --shapes, --ggml-shapes) times every distinct (type, out, in) matmul
a model runs (q/k/v and gate/up fused as loaded), or an explicit list, for a list of token
counts nt, through ops.matmul's dispatch, each case inside one executable; on a GPU the time
is the executable's span on the device timeline (jax.profiler), not the host clock
(kernel_timing.run_case says why).

Beyond llama-bench every row has: the compile time of the executable(s) it ran, achieved weight
GB/s (tg: weight bytes read per decode token / time per token) and its share of the device's
memory bandwidth, peak device memory, the backend and the JAX version.

One job per module:
  cli            flags, input checks, the two modes' run loops
  parsing        BenchError and the flag-value parsers (ranges, -pg, --shapes)
  fields         llama-bench's field schema, test names, model descriptions
  env            device, backend, memory bandwidth, build, header line
  model_tests    TestSpec, ModelBench: pp / tg / pg tests of a loaded model
  kernel_cases   which matmuls to time (ggml's rows, a model's as loaded) and one case's row
  kernel_timing  one matmul timed inside one executable, its reference, device-timeline spans
  printers       md / csv / json / jsonl output
"""
