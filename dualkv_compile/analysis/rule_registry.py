"""The registry of per-op token-axis rules: ``token_rule`` registers one, ``rule_for`` finds it.

A rule takes ``(node, info, B, S)`` (``info``: the ``NodeInfo`` of every
earlier node) and returns the node's ``NodeInfo``, or raises ``RuleFailed``
(the value is computed in the original layout) or ``Coupling`` (the graph is
refused). It is registered for call_function targets and call_method names
with ``@token_rule(*targets, methods=(...))``, as Inductor's auto_chunker
registers its propagation rules. The rule modules (``token_rules``,
``shape_rules``, ``moe_rules``) import this one and nothing imports them back
but the driver (``token_axes``), which imports all three so the table is
complete before it is read. Two rules for one target raise ``ValueError``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from .node_info import NodeInfo

__all__ = ["RULES", "Rule", "token_rule", "rule_for"]

Rule = Callable[[fx.Node, dict, int, int], NodeInfo]

# ("call_function", target) or ("call_method", name) -> rule
RULES: dict[tuple[str, object], Rule] = {}


def token_rule(*functions, methods=()) -> Callable[[Rule], Rule]:
    """Register the decorated rule for the call_function ``functions`` and the call_method ``methods``."""

    def register(rule: Rule) -> Rule:
        keys = [("call_function", f) for f in functions] + [("call_method", m) for m in methods]
        for key in keys:
            if RULES.get(key, rule) is not rule:
                raise ValueError(f"two token-axis rules for {key[1]}: {RULES[key].__name__} and {rule.__name__}")
            RULES[key] = rule
        return rule

    return register


def rule_for(node: fx.Node) -> Optional[Rule]:
    """The rule registered for ``node``'s target, or None."""
    if node.op not in ("call_function", "call_method"):
        return None
    return RULES.get((node.op, node.target))
