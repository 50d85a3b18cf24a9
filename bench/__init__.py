"""Benchmark tooling: synthetic models of real shapes, made without llama.cpp (make_model), and
`splitmoe bench run` against the services, in-process and llama.cpp (run)."""
