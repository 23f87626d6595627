"""Calibration: the declared constants (``constants``) and the profiles that assign them and
carry a machine's measured costs (``profile``). The fits that produce them run the simulator
and live above it, in :mod:`hzpsim.fitting`."""
