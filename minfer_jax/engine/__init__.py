"""The engine: the plan of executables, the pure step functions, sampling, the host loop
(scheduler), the loaded Model with its library calls (runtime), and tensor parallelism
(sharding)."""
