"""Calibration: capture hook traces on a corpus, fit the draft predictor and LoRE surrogates,
write the sidecar (docs/design.md sections 4, 5)."""
