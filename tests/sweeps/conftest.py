"""Sweeps evaluate with the evaluation tests' model and MGSM-format data."""

from tests.evaluation.conftest import math_expert  # noqa: F401
