"""Benchmark tooling: synthetic models of real shapes, made without llama.cpp."""
