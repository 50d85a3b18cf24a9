"""The floor every service stands on: settings read from the environment, logging and tracing, the
cluster's security, the machine's topology. It imports nothing else of ours, so the services, the
kernels' callers and the CLI above them may all import it."""
