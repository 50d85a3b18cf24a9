"""The engine: requests in, one step at a time (schedule, run, sample), outputs out."""
