"""The harness beside the engine: benchmarks (bench/, scripts/bench.py), the server's load test,
soak and load benchmark, and the synthetic GGUF writers (synthetic.py, quant_mix.py). Installed
with the package (the `bench` extra: its HTTP client and server); `import minfer_jax` loads none
of it."""
