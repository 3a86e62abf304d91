"""Calibration of the roofline: factors fitted from a profile (`fit`) and corrected while serving (`online`)."""

from bullet_ray.perf.calibration.factors import Calibration, PhaseCalibration
from bullet_ray.perf.calibration.fit import fit_calibration
from bullet_ray.perf.calibration.online import OnlineCorrection

__all__ = ["Calibration", "PhaseCalibration", "OnlineCorrection", "fit_calibration"]
