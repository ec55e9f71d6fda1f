"""The Gluon attention kernels' launch configs as text: parsed, and put into the kernels' tables for this process.

    parse_configs("dkdv", "dq_mode='atomic'; stages=3, block_m=64")   # [DkdvConfig(...), DkdvConfig(...)]
    use_kernel_configs("fwd: stages=3; dq: stages=3", head_dim=128)   # attention.py --gluon-configs

Shared by ``benchmarks/ops/attention.py`` (``--gluon-configs``) and ``benchmarks/tuning/gluon_tune.py`` (the
sweeps), so that neither imports the other for it. Imports nothing of benchmarks/.
"""

from __future__ import annotations

import ast
import dataclasses

from dualkv_compile.kernels.gluon import attention as ga

KINDS = {"fwd": ga.FwdConfig, "dq": ga.DqConfig, "dkdv": ga.DkdvConfig}
TABLES = {"fwd": ga.FWD_CONFIGS, "dq": ga.DQ_CONFIGS, "dkdv": ga.DKDV_CONFIGS}


def parse_configs(kind: str, text: str) -> list:
    """The configs of ``text`` ("a=1, b='x'; a=2"), each a ``KINDS[kind]``; ValueError naming what is wrong."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
    cls = KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    configs = []
    for part in (p.strip() for p in text.split(";")):
        kwargs = {}
        for item in (i.strip() for i in part.split(",") if i.strip()):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(f"configs: {item!r} is not field=value with a field of {cls.__name__} ({sorted(names)})")
            try:
                kwargs[name] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise ValueError(f"configs: the value of {name!r} is not a Python literal: {value.strip()!r}") from None
            want = type(getattr(cls, name))  # every field has a default: its type is the field's
            got = kwargs[name]
            if type(got) is not want and not (want is float and type(got) is int):
                raise ValueError(f"configs: {name}={got!r}: expected {want.__name__} for {cls.__name__}.{name}")
        configs.append(cls(**kwargs))
    return configs


def config_text(c) -> str:
    """``c`` as ``parse_configs`` reads it: the tile fields, then every other field off its class default."""
    tile = ("block_m", "block_n", "stages")
    return ", ".join(f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)
                     if f.name in tile or getattr(c, f.name) != f.default)


def parse_kernel_configs(text: str) -> dict:
    """``{kind: config}`` of ``--gluon-configs`` text ("fwd: block_n=64, stages=3; dq: stages=3"), any subset of
    the kernels, each once; ValueError naming the option and what it expected."""
    opt = "--gluon-configs"
    form = "'kernel: field=value, ...' parts separated by ';'"
    configs = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        kind, sep, fields = part.partition(":")
        kind = kind.strip()
        if not sep:
            raise ValueError(f"{opt}: {part!r} names no kernel: expected {form}, kernel one of {sorted(KINDS)}")
        if kind not in KINDS:
            raise ValueError(f"{opt}: {kind!r} is not a kernel: expected one of {sorted(KINDS)} in {form}")
        if kind in configs:
            raise ValueError(f"{opt}: kernel {kind!r} is given twice: expected each kernel at most once")
        try:
            (configs[kind],) = parse_configs(kind, fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{opt}: {kind}: {e}") from None
    if not configs:
        raise ValueError(f"{opt}: no kernel in {text!r}: expected {form}, kernel one of {sorted(KINDS)}")
    return configs


def use_kernel_configs(text, head_dim: int) -> dict:
    """Put the configs of ``--gluon-configs`` text (None: none) into the tables of ``kernels/gluon/attention.py``
    at ``head_dim``, for this process; the record of what the kernels now run: ``{kind: config_text}``,
    ``"head_dim"`` and ``"set"``, the kernels ``text`` named."""
    configs = {} if text is None else parse_kernel_configs(text)
    if head_dim not in ga.FWD_CONFIGS:
        if configs:
            raise ValueError(f"--gluon-configs: head dim {head_dim} has no Gluon configs: "
                             f"expected --head-dim one of {sorted(ga.FWD_CONFIGS)}")
        return {}
    for kind, c in configs.items():
        TABLES[kind][head_dim] = c
    return dict({kind: config_text(TABLES[kind][head_dim]) for kind in KINDS}, head_dim=head_dim, set=sorted(configs))
