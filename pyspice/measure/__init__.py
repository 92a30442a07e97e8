"""Measuring real runs: bench, probe, perplexity and the recorder of bench's workload.

Each drives a loaded `pyspice.Llama`; the simulator replays what they record.
"""
