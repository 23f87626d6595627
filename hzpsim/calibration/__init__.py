"""Calibration: the declared constants (``constants``), profiles that assign them (``profile``),
and the fit to measured runs with leave-one-source-out cross-validation (``fit``)."""
