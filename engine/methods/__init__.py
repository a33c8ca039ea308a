"""Merge methods. Each turns a recipe into a per-tensor rule; the planner does the rest."""

from __future__ import annotations

from collections.abc import Callable

from engine.methods.base import Inputs, MethodPlan
from engine.methods.layer_swap import plan_layer_swap
from engine.methods.linear import plan_linear
from engine.methods.passthrough import plan_passthrough
from engine.methods.slerp import plan_slerp
from engine.methods.soup import plan_soup
from engine.methods.task_arithmetic import plan_task_arithmetic
from engine.methods.ties import plan_ties

BUILDERS: dict[str, Callable[..., MethodPlan]] = {
    "layer_swap": plan_layer_swap,
    "soup": plan_soup,
    "task_arithmetic": plan_task_arithmetic,
    "ties": plan_ties,
    "linear": plan_linear,
    "slerp": plan_slerp,
    "passthrough": plan_passthrough,
}

__all__ = ["BUILDERS", "Inputs", "MethodPlan"]
