"""Entropy over the vocabulary, as loss code writes it: the patterns ``fuse_linear_log_prob`` fuses.

Contract
    ``log_prob_entropy(logp, readers)`` and ``logit_entropy(x, readers)`` look at the FX nodes ``readers`` (users
    of the log-probs ``logp``, or of the logits ``x``) and return an ``EntropyMatch`` when they are exactly one of
    the patterns below, else a sentence saying why not. They change nothing.

Matched (Dynamo's spellings: ``torch.f(x)``, ``x.f()``, operators; every reduction over the last dim of a 3-D
value, ``-1`` or ``2``, without ``keepdim`` or ``dtype``; every node between the source and the result has one
user):

    from the log-probs ``logp``:  (exp(logp) * logp).sum(-1) with any number of negations on ``exp(logp)``, on
        the ``logp`` operand, on the product or on the sum (``-(p * logp).sum(-1)``, ``(-p * logp).sum(-1)``,
        ``torch.neg(...)``, ...), the multiply in either order. An odd number of negations gives the entropy, an
        even number minus the entropy (``EntropyMatch.negated``). Its readers of ``logp``: the ``exp`` and the
        multiply (or the negation of ``logp``).
    from the logits ``x`` (veRL's ``entropy_from_logits``): logsumexp(x, -1) - sum(softmax(x, -1) * x, -1), the
        multiply in either order, any spelling of softmax. Its readers of ``x``: the softmax, the logsumexp and
        the multiply.

Anything else is not matched (the rule: the readers compute exactly the entropy and nothing else is read whole),
e.g. ``torch.special.entr``, another dim, ``keepdim``, a mean, a scale inside the pattern, an intermediate with
another reader.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import is_call

__all__ = ["EntropyMatch", "log_prob_entropy", "logit_entropy"]

_EXP = ((torch.exp,), ("exp",))
_NEG = ((operator.neg, torch.neg), ("neg", "__neg__"))
_MUL = ((operator.mul, torch.mul), ("mul", "multiply", "__mul__", "__rmul__"))
_SUM = ((torch.sum,), ("sum",))
_SUB = ((operator.sub, torch.sub), ("sub", "__sub__"))
_SOFTMAX = ((F.softmax, torch.softmax, torch.special.softmax), ("softmax",))
_LOGSUMEXP = ((torch.logsumexp, torch.special.logsumexp), ("logsumexp",))
_LAST_DIM = (-1, 2)  # the vocabulary dim of a [1, T, V] packed value


@dataclasses.dataclass
class EntropyMatch:
    """A matched entropy: ``final``'s value is the entropy per token (minus it if ``negated``); ``nodes``: the
    pattern's nodes, ``final`` included (erased once ``final`` is replaced); ``readers``: those reading the source."""

    final: fx.Node
    nodes: list[fx.Node]
    negated: bool
    readers: set[fx.Node]


def _unary(n, kind, x=None) -> bool:
    """``n`` is ``kind`` applied to one tensor (``x`` if given), no other arguments."""
    return is_call(n, *kind) and len(n.args) == 1 and not n.kwargs and (x is None or n.args[0] is x)


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _other_operand(mul, x) -> Optional[fx.Node]:
    """The other factor of ``mul`` = ``x * y`` or ``y * x`` (a node), else None."""
    if not is_call(mul, *_MUL) or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    other = b if a is x else a if b is x else None
    return other if isinstance(other, fx.Node) and other is not x else None


def _last_dim_reduction(n, kind, x) -> bool:
    """``n`` reduces ``x`` over the last dim (``dim`` positional or keyword, int or one-element list)."""
    if not is_call(n, *kind) or not n.args or n.args[0] is not x:
        return False
    kwargs = dict(n.kwargs)
    if len(n.args) > 2 or (len(n.args) == 2 and "dim" in kwargs):
        return False
    dim = n.args[1] if len(n.args) == 2 else kwargs.pop("dim", None)
    kwargs.pop("_stacklevel", None)  # F.softmax's
    if kwargs.pop("keepdim", False) or kwargs.pop("dtype", None) is not None or kwargs:
        return False
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return dim in _LAST_DIM


def log_prob_entropy(logp: fx.Node, readers) -> Union[EntropyMatch, str]:
    """``readers`` (users of ``logp``) as ``±(exp(logp) * logp).sum(-1)``, else why not (module docstring)."""
    readers = set(readers)
    exps = [u for u in readers if _unary(u, _EXP, logp)]
    if len(exps) != 1:
        return "not an entropy: no single exp of the log-probs"
    e = exps[0]
    nodes, negs = [e], 0
    p = e
    if _unary(_only_user(p), _NEG, p):  # -exp(logp)
        p = _only_user(p)
        nodes.append(p)
        negs += 1
    mul = _only_user(p)
    other = _other_operand(mul, p) if mul is not None else None
    if other is logp:
        direct = {e, mul}
    elif other is not None and _unary(other, _NEG, logp) and len(other.users) == 1:  # p * -logp
        direct = {e, other}
        nodes.append(other)
        negs += 1
    else:
        return f"not an entropy: {e.name} is not multiplied by the log-probs alone"
    if readers != direct:
        extra = ", ".join(sorted(u.name for u in readers - direct))
        return f"not an entropy alone: {extra} read the log-probs too"
    nodes.append(mul)
    product = mul
    if _unary(_only_user(product), _NEG, product):  # -(p * logp)
        product = _only_user(product)
        nodes.append(product)
        negs += 1
    s = _only_user(product)
    if s is None or not _last_dim_reduction(s, _SUM, product):
        return f"not an entropy: {product.name} is not summed over the vocabulary (last) dim alone"
    nodes.append(s)
    final = s
    if _unary(_only_user(s), _NEG, s):  # -(...).sum(-1)
        final = _only_user(s)
        nodes.append(final)
        negs += 1
    return EntropyMatch(final, nodes, negated=negs % 2 == 0, readers=direct)


def logit_entropy(x: fx.Node, readers) -> Union[EntropyMatch, str]:
    """``readers`` (users of ``x``) as ``logsumexp(x, -1) - sum(softmax(x, -1) * x, -1)``, else why not."""
    readers = set(readers)
    softmaxes = [u for u in readers if _last_dim_reduction(u, _SOFTMAX, x)]
    lses = [u for u in readers if _last_dim_reduction(u, _LOGSUMEXP, x)]
    if len(softmaxes) != 1 or len(lses) != 1:
        return "not an entropy: no single softmax and logsumexp of the logits over the last dim"
    sm, lse = softmaxes[0], lses[0]
    mul = _only_user(sm)
    if mul is None or _other_operand(mul, sm) is not x:
        return f"not an entropy: {sm.name} is not multiplied by the logits alone"
    direct = {sm, lse, mul}
    if readers != direct:
        extra = ", ".join(sorted(u.name for u in readers - direct))
        return f"not an entropy alone: {extra} read the logits too"
    s = _only_user(mul)
    if s is None or not _last_dim_reduction(s, _SUM, mul):
        return f"not an entropy: {mul.name} is not summed over the vocabulary (last) dim alone"
    d = _only_user(s)
    if d is None or _only_user(lse) is not d or not is_call(d, *_SUB) or d.args != (lse, s) or d.kwargs:
        return f"not an entropy: {s.name} is not subtracted from {lse.name}"
    return EntropyMatch(d, [sm, lse, mul, s, d], negated=False, readers=direct)
