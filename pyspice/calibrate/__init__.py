"""Calibration: capture hook traces on a corpus, fit the draft predictor and LoRE surrogates,
write the sidecar (DESIGN sections 4, 5)."""
