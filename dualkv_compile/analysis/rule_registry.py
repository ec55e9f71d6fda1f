"""The registry of per-op token-axis rules: ``token_rule`` registers one, ``rule_for`` finds it.

A rule takes ``(node, info, B, S)`` (``info``: the ``NodeInfo`` of every
earlier node) and returns the node's ``NodeInfo``, or raises ``RuleFailed``
(the value is computed in the original layout) or ``Coupling`` (the graph is
refused). It is registered for call_function targets and call_method names
with ``@token_rule(*targets, methods=(...))``, as Inductor's auto_chunker
registers its propagation rules. The rule modules (``token_rules``,
``shape_rules``, ``moe_rules`` and ``moe_copies``, which ``moe_rules``
imports) import this one and nothing imports them back but the driver
(``token_axes``) and ``moe_rules``; the driver imports the first three, so
the table is complete before it is read. Two rules for one target raise ``ValueError``.

A rule module may also *refine* another module's rule for a special case it
owns (``@refine_rule(...)``: ``moe_copies`` takes the view that merges a
feature dim with the token axis as expert-major copies, which ``shape_rules``'
view rule computes in the original layout). A refinement returns a
``NodeInfo`` (or raises) where it applies and None where it does not;
``rule_for`` then gives a rule that tries the target's refinements, in the
order they were registered, before its rule, so each module keeps its own
rules and the general one need not know the special case.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch.fx as fx

from .node_info import NodeInfo, RuleFailed, op_name

__all__ = ["REFINEMENTS", "RULES", "Rule", "token_rule", "refine_rule", "rule_for"]

Rule = Callable[[fx.Node, dict, int, int], NodeInfo]

# ("call_function", target) or ("call_method", name) -> rule
RULES: dict[tuple[str, object], Rule] = {}
# the same keys -> refinements (rules that may return None: "not my case"), tried before RULES' rule
REFINEMENTS: dict[tuple[str, object], list[Callable[[fx.Node, dict, int, int], Optional[NodeInfo]]]] = {}


def _keys(functions, methods) -> list[tuple[str, object]]:
    return [("call_function", f) for f in functions] + [("call_method", m) for m in methods]


def token_rule(*functions, methods=()) -> Callable[[Rule], Rule]:
    """Register the decorated rule for the call_function ``functions`` and the call_method ``methods``."""

    def register(rule: Rule) -> Rule:
        for key in _keys(functions, methods):
            if RULES.get(key, rule) is not rule:
                raise ValueError(f"two token-axis rules for {key[1]}: {RULES[key].__name__} and {rule.__name__}")
            RULES[key] = rule
        return rule

    return register


def refine_rule(*functions, methods=()) -> Callable:
    """Register the decorated refinement (module docstring) for the call_function ``functions`` and the
    call_method ``methods``."""

    def register(refinement):
        for key in _keys(functions, methods):
            if refinement not in REFINEMENTS.setdefault(key, []):
                REFINEMENTS[key].append(refinement)
        return refinement

    return register


def rule_for(node: fx.Node) -> Optional[Rule]:
    """The rule registered for ``node``'s target (tried after its refinements, if it has any), or None."""
    if node.op not in ("call_function", "call_method"):
        return None
    key = (node.op, node.target)
    rule, refinements = RULES.get(key), REFINEMENTS.get(key)
    if not refinements:
        return rule
    return functools.partial(_refined, tuple(refinements), rule)


def _refined(refinements, rule: Optional[Rule], node: fx.Node, info, B: int, S: int) -> NodeInfo:
    for refinement in refinements:
        res = refinement(node, info, B, S)
        if res is not None:
            return res
    if rule is None:
        raise RuleFailed(f"no token-axis rule for {op_name(node)}")  # the driver's words for a target without one
    return rule(node, info, B, S)
