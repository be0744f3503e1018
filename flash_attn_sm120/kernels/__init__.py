"""Kernel families: one module each. `fwd_cpasync`: upstream's SM120 forward, opened up."""
