"""SplitMoE: Mixture-of-Experts serving split across an attention service and expert services."""
import kernels  # noqa: F401 - first, before anything loads torch: it sets the runtimes' defaults
