"""Merge methods. Each module declares one method whole (its recipe schema, its per-tensor
rule, how it is described); this table is the only list of them."""

from __future__ import annotations

from engine.methods import (
    breadcrumbs,
    dare,
    della,
    layer_swap,
    linear,
    passthrough,
    slerp,
    soup,
    task_arithmetic,
    ties,
)
from engine.methods.base import Inputs, Method, MethodPlan

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        layer_swap.METHOD,
        soup.METHOD,
        task_arithmetic.METHOD,
        ties.METHOD,
        linear.METHOD,
        slerp.METHOD,
        passthrough.METHOD,
        dare.DARE_TIES,
        dare.DARE_LINEAR,
        breadcrumbs.BREADCRUMBS,
        breadcrumbs.BREADCRUMBS_TIES,
        della.DELLA,
        della.DELLA_LINEAR,
    )
}

__all__ = ["METHODS", "Inputs", "Method", "MethodPlan"]
