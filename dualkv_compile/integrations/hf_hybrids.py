"""Hugging Face hybrids' recurrent cores as opaque ops: the gated delta rule (Qwen3-Next, Qwen3.5 dense and MoE,
OLMo-hybrid; Kimi-linear's KDA), the Mamba-2 SSD scan (Mamba-2, Nemotron-H, Falcon-H1, Bamba, Zamba2, GraniteMoeHybrid) and the
Mamba (v1) selective scan (Mamba, Falcon-Mamba, Jamba).

Assumes: a modeling module whose layer calls its ``torch_chunk_gated_delta_rule`` (``chunk_kimi_delta_attention``), ``mamba2_chunk_scan`` or
``mamba_selective_scan``: the hub wrapper (``use_kernel_func_from_hub_with_fallback``) around the torch fallback,
running the fallback itself (fla / mamba-ssm not installed) or, for the GDN and KDA, flash-linear-attention's
``chunk_gated_delta_rule`` / ``chunk_kda`` (the op then calls that: the eager model's kernel); a wrapper that runs
anything else is left alone.

Guarantees: ``opaque_recurrent_cores()`` registers, for each such function of each module imported, a Dynamo
polyfill (``torch.compiler.substitute_in_graph``) of the wrapper that calls the op of ``ops.recurrent`` with the
fallback as its ``impl``: Dynamo puts one op per layer call in the graph instead of tracing the scan, AOTAutograd does not trace into it, and its forward and
backward are the fallback's own eager forward and autograd (exact; the torch bug this avoids: ``ops.recurrent``).
Eager calls never see the polyfill; under ``torch.export`` it traces the fallback as the wrapper does. As the
wrapper, ``cu_seqlens``/``seq_idx`` raise ``ValueError`` and keywords the fallback does not name are dropped; a
cached or final state asked for calls the fallback (Dynamo traces it: generation's path, never packed). ``install()`` (run by ``import dualkv_compile``) registers the
modules already imported and, through a finder first in ``sys.meta_path``, each modeling module as it is
imported: no change to the user's code, and ``torch._dynamo.reset()`` keeps the polyfills. They are
process-wide (Dynamo keeps one per function, whichever backend compiles): exact for every backend, but an
Inductor compile then runs the fallback's scan eagerly inside the op, its backward recomputing the forward.
A registration that fails is logged and the layer compiles as before. The op is the node a forest scan would
replace (docs/design.md, semantics 16).
"""

from __future__ import annotations

import importlib.abc
import inspect
import logging
import re
import sys

import torch

from ..ops.recurrent import gated_delta_rule, mamba2_chunk_scan, mamba_selective_scan, named_keywords

log = logging.getLogger("dualkv_compile")

__all__ = ["gdn_polyfill", "hub_wrapper_parts", "install", "opaque_recurrent_cores", "register_module"]

_DONE: set[int] = set()  # ids of the wrappers looked at (registered or left alone)
_KEEP: list = []  # the wrappers looked at, so that an id is never reused


def hub_wrapper_parts(wrapper):
    """``(fallback, implementation)`` of transformers' hub wrapper: the torch fallback it wraps and the function it
    runs (the fallback itself, or a kernel library's); None for anything else."""
    fallback = getattr(wrapper, "__wrapped__", None)
    if fallback is None or not callable(wrapper) or getattr(wrapper, "__closure__", None) is None:
        return None
    try:
        runs = inspect.getclosurevars(wrapper).nonlocals.get("implementation")
    except (TypeError, ValueError):
        return None
    return None if runs is None else (fallback, runs)


def _kernel_name(runs) -> str | None:
    """``"module.name"`` of a flash-linear-attention function, where that name resolves to it, else None."""
    module, name = getattr(runs, "__module__", None) or "", getattr(runs, "__name__", "")
    if not module.startswith("fla.") or getattr(sys.modules.get(module), name, None) is not runs:
        return None
    return f"{module}.{name}"


def _exporting() -> bool:
    """Whether ``torch.export`` is tracing: its flag, read directly (Dynamo reads the global). Not
    ``torch.compiler.is_exporting()``: torch 2.11's Dynamo folds that to True under every ``torch.compile``
    (2.13 reads the flag), which would send every compiled call to the traced fallback."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def _as_the_wrapper(kwargs: dict, named: frozenset, impl: str, package: str) -> dict:
    """The hub wrapper's handling of extra keywords: packed sequences (``cu_seqlens``/``seq_idx``) raise, as the
    torch fallback cannot keep them apart; the keywords the fallback does not name are dropped."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
        raise ValueError(f"`{impl}` can't keep packed sequences apart without {package}")
    return {k: v for k, v in kwargs.items() if k in named}


def gdn_polyfill(fallback, impl: str, kernel=None):
    """A function with the GDN fallback's signature (and defaults) calling the opaque op with ``impl``: the
    fallback's name, or ``kernel``'s (flash-linear-attention's, which the wrapper runs instead). As the wrapper,
    packed sequences (``cu_seqlens``) and any other keyword ``kernel`` names go to ``kernel`` itself (Dynamo does not
    trace it: that call runs unpacked); without a kernel, packed sequences raise."""
    params = inspect.signature(fallback).parameters
    default_chunk = params["chunk_size"].default
    named = named_keywords(fallback) if kernel is None else named_keywords(kernel)

    def polyfill(query, key, value, g, beta, chunk_size=default_chunk, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        own = {k: v for k, v in kwargs.items() if k in named and v is not None}
        if kernel is not None and own:  # packed sequences, or a keyword the op does not carry: the kernel itself
            return kernel(query, key, value, g, beta, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **own)
        _as_the_wrapper(kwargs, named, impl, "flash-linear-attention")  # no other keyword reaches the op
        if _exporting():  # as the wrapper: the fallback, its other keyword arguments dropped
            return fallback(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return gated_delta_rule(query, key, value, g, beta, impl=impl, chunk_size=chunk_size,
                                initial_state=initial_state, output_final_state=output_final_state,
                                use_qk_l2norm=use_qk_l2norm_in_kernel)

    return polyfill


def _mamba2_polyfill(fallback, impl: str):
    """A function with the Mamba-2 fallback's signature calling the opaque op from a zero state, else the fallback.

    As the wrapper: ``cu_seqlens``/``seq_idx`` raise ``ValueError``, and a keyword the fallback does not name
    (``z``, ``output_router_logits``: layers pass their own) is dropped before the call."""
    named = named_keywords(fallback)

    def polyfill(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                 dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        kwargs = _as_the_wrapper(kwargs, named, impl, "mamba-ssm")
        if initial_states is not None or return_final_states or _exporting() or kwargs:
            return fallback(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        return mamba2_chunk_scan(hidden_states, dt, A, B, C, impl=impl, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                                 dt_softplus=dt_softplus, dt_limit=tuple(dt_limit))

    return polyfill


def _mamba1_polyfill(fallback, impl: str):
    """A function with the Mamba (v1) fallback's signature calling the opaque op, else the fallback (the last
    state asked for); as the wrapper for packed sequences and unnamed keywords (``_mamba2_polyfill``)."""
    named = named_keywords(fallback)

    def polyfill(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                 return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        kwargs = _as_the_wrapper(kwargs, named, impl, "mamba-ssm")
        if return_last_state or _exporting() or kwargs:
            return fallback(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            use_mambapy=use_mambapy, use_associative_scan=use_associative_scan, **kwargs)
        return mamba_selective_scan(hidden_states, dt, A, B, C, impl=impl, D=D, z=z, delta_bias=delta_bias,
                                    delta_softplus=delta_softplus, use_mambapy=use_mambapy,
                                    use_associative_scan=use_associative_scan)

    return polyfill


# The functions routed to an op, each with the polyfill that routes it.
_POLYFILLS = {"torch_chunk_gated_delta_rule": gdn_polyfill, "chunk_kimi_delta_attention": gdn_polyfill,
              "mamba2_chunk_scan": _mamba2_polyfill,
              "mamba_selective_scan": _mamba1_polyfill}


def register_module(name: str, module) -> int:
    """Register the polyfills of ``module``'s hub wrappers that run their torch fallback; how many it registered."""
    return sum(_register_one(name, module, function, make) for function, make in _POLYFILLS.items())


def _register_one(name: str, module, function: str, make) -> bool:
    # The module's own namespace, not getattr: a transformers package is a lazy module whose getattr imports (and
    # may fail on a missing optional dependency), and which re-exports its modeling module's functions.
    wrapper = vars(module).get(function)
    if wrapper is None or id(wrapper) in _DONE:
        return False
    _DONE.add(id(wrapper))
    _KEEP.append(wrapper)
    pair = hub_wrapper_parts(wrapper)
    fallback, runs = pair if pair is not None else (None, None)
    if fallback is None or getattr(fallback, "__module__", None) != name:
        log.info("dualkv: %s.%s is not transformers' hub wrapper of its torch fallback: left alone", name, function)
        return False
    if runs is fallback:
        polyfill = make(fallback, f"{name}.{function}")
    elif make is gdn_polyfill and _kernel_name(runs):  # fla's chunk_gated_delta_rule or chunk_kda
        polyfill = make(fallback, _kernel_name(runs), kernel=runs)
    else:
        log.info("dualkv: %s.%s runs %s, which no op here calls: left alone (traced by Dynamo)", name, function,
                 getattr(runs, "__module__", runs))
        return False
    try:
        # The wrapper's (unwrapped) signature is the fallback's, and the polyfill's: Dynamo checks that they agree.
        torch.compiler.substitute_in_graph(wrapper)(polyfill)
    except Exception as e:  # a changed signature, a polyfill of another library: the layer compiles as before
        log.warning("dualkv: %s.%s stays traced by Dynamo: %s", name, function, e)
        return False
    return True


def opaque_recurrent_cores() -> int:
    """Register the polyfills for every imported transformers module's recurrent hub wrappers (module docstring)."""
    return sum(register_module(name, module) for name, module in list(sys.modules.items())
               if name.startswith("transformers.models.") and module is not None)


_MODELING = re.compile(r"transformers\.models\.[^.]+\.modeling_[^.]+")


class _Loader(importlib.abc.Loader):
    """A modeling module's own loader, then its registration (a failure is logged, never raised)."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            register_module(module.__name__, module)
        except Exception as e:  # the user's import must not fail for it: the layer then compiles as before
            log.warning("dualkv: %s's recurrent cores stay traced by Dynamo: %s", module.__name__, e)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the module's own loader's
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds a transformers modeling module with the finders after it and wraps its loader in ``_Loader``."""

    def find_spec(self, fullname, path, target=None):
        if not _MODELING.fullmatch(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> int:
    """``opaque_recurrent_cores()`` now, and on every transformers modeling module imported later (once per
    process: a finder first in ``sys.meta_path``). Returns how many wrappers it registered now."""
    if not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())
    return opaque_recurrent_cores()
