"""Offline planning: cost model, feasibility, layout policy, simulator, regimes, calibration."""
