"""Merge methods. Each module declares one method whole (its recipe schema, its per-tensor
rule, its formula, its mergekit translation, how it is described); METHODS is the only list of
them, and everything else derives from it when built or asked (engine/methods/base.py)."""

from __future__ import annotations

from engine.methods import (
    arcee_fusion,
    breadcrumbs,
    dare,
    della,
    karcher,
    layer_swap,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    sce,
    slerp,
    soup,
    task_arithmetic,
    ties,
)
from engine.methods.base import Inputs, Method, MethodPlan

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method to METHODS: the recipe schema, the API, GET /v1/methods, the docs' table
    and the mergekit front end take it from there. Refuses a name, or a mergekit method name,
    that another method has."""
    if method.name in METHODS:
        raise ValueError(f"a method named {method.name} is registered already")
    taken = set(method.mergekit.names if method.mergekit else ()) & set(mergekit_methods())
    if taken:
        raise ValueError(f"mergekit's {sorted(taken)[0]} is translated by another method")
    METHODS[method.name] = method
    return method


def mergekit_methods() -> dict[str, Method]:
    """mergekit's method name -> the method that translates it."""
    return {
        name: method
        for method in METHODS.values()
        if method.mergekit is not None
        for name in method.mergekit.names
    }


for _method in (
    layer_swap.METHOD,
    soup.METHOD,
    task_arithmetic.METHOD,
    ties.METHOD,
    linear.METHOD,
    slerp.METHOD,
    nuslerp.METHOD,
    passthrough.METHOD,
    model_stock.METHOD,
    dare.DARE_TIES,
    dare.DARE_LINEAR,
    breadcrumbs.BREADCRUMBS,
    breadcrumbs.BREADCRUMBS_TIES,
    della.DELLA,
    della.DELLA_LINEAR,
    multislerp.METHOD,
    karcher.METHOD,
    nearswap.METHOD,
    sce.METHOD,
    arcee_fusion.METHOD,
    ram.RAM,
    ram.RAMPLUS_TL,
):
    register(_method)

__all__ = ["METHODS", "Inputs", "Method", "MethodPlan", "mergekit_methods", "register"]
