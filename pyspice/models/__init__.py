"""Model files pyspice makes: synthetic random-weight MoE GGUFs for tests and timing."""
