"""Each distinct image once through a Hugging Face vision-language model's vision tower (docs/design.md, semantics 17).

    counter = dualkv_compile.images_once(model)     # before or after torch.compile(model, backend="dualkv")
    counter.patches, counter.images                 # what the tower ran on, summed over calls (patches: rows of
                                                    # pixel_values, images themselves for an [N, C, H, W] tower)

Assumes: the model (or a submodule) has ``get_image_features(pixel_values, image_grid_thw=None, **kw)`` (and
``get_video_features`` alike) that the forward calls through the instance, images independent in the tower (each
image's features depend on its own pixels only: true of the Qwen2-VL family's per-image attention and of towers
that take ``[num_images, C, H, W]``), and an output whose per-image fields are a tuple or list with one tensor per
image (``pooler_output`` of transformers 5.x; ``deepstack_features``, a list of such tuples) or a tensor whose first
axis holds the images' patches (``last_hidden_state``) or the images.
Guarantees: the tower runs on the distinct images only (bitwise equal pixels and grid: hashed, then verified
bitwise, so a collision only costs a second run), and each original image's outputs are its distinct image's
tensors, so the features are equal to the unwrapped call's and their gradient is the sum over every row that used
the image. An output field it cannot expand raises ``ValueError`` naming it; a call with nothing repeated runs the
original. The wrapper runs outside Dynamo (``torch._dynamo.disable``: the images' fingerprints are read on the host),
and calls the tower compiled (``backend``, Inductor by default) or eagerly; the language model's graphs after it
get the features as inputs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import torch

from ..layout.carried import as_bits

__all__ = ["ImagesOnce", "images_once", "is_vision_language"]

_MARK = "_dualkv_images_once"
_METHODS = ("get_image_features", "get_video_features")


@dataclasses.dataclass
class ImagesOnce:
    """What the wrapped towers ran on, summed over calls: ``images`` / ``patches`` given and run."""

    images_in: int = 0
    images: int = 0
    patches_in: int = 0
    patches: int = 0
    wrapped: tuple[str, ...] = ()


def is_vision_language(model: torch.nn.Module) -> bool:
    """True if a module of ``model`` has ``get_image_features`` or ``get_video_features``."""
    return any(callable(getattr(type(m), f, None)) for m in model.modules() for f in _METHODS)


def images_once(model: torch.nn.Module, backend: Optional[str] = "inductor") -> ImagesOnce:
    """Wrap every ``get_image_features`` / ``get_video_features`` of ``model``'s modules (see the module docstring);
    the tower runs compiled with ``backend`` (what ``torch.compile`` would have run it with: dualkv leaves a vision
    tower's graphs to its inner compiler), or eagerly with ``None`` / ``"eager"``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"images_once(model): expected a torch.nn.Module, got {type(model).__name__}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"images_once(backend=...): expected a torch.compile backend name or None, got {backend!r}")
    found = getattr(model, _MARK, None)
    if found is not None:
        return found
    counter = ImagesOnce()
    # The innermost modules with the methods: an outer one (a ForConditionalGeneration) delegates to them.
    has = {path: m for path, m in model.named_modules() if any(callable(getattr(type(m), f, None)) for f in _METHODS)}
    inner = [path for path in has if not any(o != path and o.startswith(f"{path}.") or (path == "" and o) for o in has)]
    if not inner:
        raise ValueError(f"images_once(model): {type(model).__name__} has no module with get_image_features or "
                         "get_video_features (not a vision-language model?)")
    earlier = next((getattr(has[p], _MARK) for p in inner if getattr(has[p], _MARK, None) is not None), None)
    if earlier is not None:
        return earlier
    names = []
    for path in inner:
        module = has[path]
        for method in _METHODS:
            if callable(getattr(type(module), method, None)):
                setattr(module, method, _wrap(getattr(module, method), counter, backend))
                names.append(f"{path or type(module).__name__}.{method}")
        setattr(module, _MARK, counter)
    counter.wrapped = tuple(names)
    if getattr(model, _MARK, None) is None:
        setattr(model, _MARK, counter)
    return counter


def _wrap(method, counter: ImagesOnce, backend: Optional[str]):
    # A compiled call made from the disabled wrapper at run time: Dynamo traces the tower as torch.compile would.
    original = method if backend in (None, "eager") else torch.compile(method, backend=backend)
    signature = inspect.signature(method)
    named = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not named:
        raise ValueError(f"images_once: {getattr(method, '__qualname__', method)} takes no pixels argument")
    # pixel_values(_videos), then the grid where the tower takes one (image_grid_thw / video_grid_thw); a tower
    # without one takes a batch of images on the first axis (Gemma 3's [N, C, H, W]).
    pixels_name = named[0].name
    grid_name = named[1].name if len(named) > 1 and "grid" in named[1].name else None

    @torch._dynamo.disable
    def features_once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        pixel_values = bound.arguments[pixels_name]
        grid_thw = bound.arguments.get(grid_name) if grid_name else None
        pieces = _split_images(pixel_values, grid_thw)
        keep, index = _distinct(pieces, grid_thw)
        counter.images_in += len(pieces)
        counter.patches_in += int(pixel_values.shape[0])
        if len(keep) == len(pieces):
            counter.images += len(pieces)
            counter.patches += int(pixel_values.shape[0])
            return original(*args, **kwargs)
        bound.arguments[pixels_name] = torch.cat([pieces[i] for i in keep]) if grid_thw is not None else pixel_values[keep]
        if grid_thw is not None:
            bound.arguments[grid_name] = grid_thw[keep]
        counter.images += len(keep)
        counter.patches += int(bound.arguments[pixels_name].shape[0])
        out = original(*bound.args, **bound.kwargs)
        sizes = [int(pieces[i].shape[0]) for i in keep] if grid_thw is not None else None
        return _expand(out, index, len(keep), sizes)

    # The original's name and signature: generate() picks the encoder's keyword arguments by its parameter names.
    features_once.__name__ = getattr(method, "__name__", "features_once")
    features_once.__signature__ = signature
    return features_once


def _split_images(pixel_values: torch.Tensor, grid_thw: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per image: rows by ``grid_thw`` (patches t * h * w each), else the first axis."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"images_once: pixel_values must be a tensor, got {type(pixel_values).__name__}")
    if grid_thw is None:
        return list(pixel_values.unbind(0))
    sizes = grid_thw.prod(-1).tolist()
    if sum(sizes) != pixel_values.shape[0]:
        raise ValueError(f"images_once: image_grid_thw gives {sum(sizes)} patches, pixel_values has "
                         f"{pixel_values.shape[0]} rows")
    return list(torch.split(pixel_values, sizes))


def _distinct(pieces: list[torch.Tensor], grid_thw: Optional[torch.Tensor]) -> tuple[list[int], list[int]]:
    """``keep`` (the first index of each distinct image) and ``index`` (each image's position in ``keep``)."""
    grids = grid_thw.tolist() if grid_thw is not None else [None] * len(pieces)
    # A fingerprint per image (two sums of its bits, one pass, one host transfer), then a bitwise check.
    prints = []
    for p in pieces:
        b = as_bits(p.detach()).reshape(-1).to(torch.float64)
        w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.float64).remainder_(65521)
        prints.append(torch.stack([b.sum(), (b * w).sum()]))
    prints = torch.stack(prints).tolist() if prints else []
    keep: list[int] = []
    index: list[int] = []
    by_key: dict[tuple, list[int]] = {}
    for i, p in enumerate(pieces):
        key = (tuple(p.shape), p.dtype, str(grids[i]), *prints[i])
        bits = as_bits(p.detach())
        match = next((k for k in by_key.get(key, ()) if torch.equal(as_bits(pieces[keep[k]].detach()), bits)), None)
        if match is None:
            match = len(keep)
            keep.append(i)
            by_key.setdefault(key, []).append(match)
        index.append(match)
    return keep, index


def _expand(out: Any, index: list[int], num_distinct: int, sizes: Optional[list[int]]) -> Any:
    """``out`` of the distinct images, laid out for every original image (``index``): see the module docstring."""
    fields = out.keys() if hasattr(out, "keys") else None
    if fields is None:
        return _expand_value(out, "output", index, num_distinct, sizes)
    for name in list(fields):
        out[name] = _expand_value(out[name], name, index, num_distinct, sizes)
    return out


def _expand_value(value: Any, name: str, index: list[int], num_distinct: int, sizes: Optional[list[int]]) -> Any:
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == num_distinct and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(value[j] for j in index) if isinstance(value, tuple) else [value[j] for j in index]
    if isinstance(value, (tuple, list)) and all(isinstance(v, (tuple, list)) for v in value):
        return type(value)(_expand_value(v, name, index, num_distinct, sizes) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape[0] == num_distinct and sizes is None:
            return value[torch.tensor(index, device=value.device)]
        if sizes is not None and value.shape[0] == sum(sizes):
            blocks = torch.split(value, sizes)
            return torch.cat([blocks[j] for j in index])
    raise ValueError(f"images_once: cannot lay out the vision tower's output {name!r} "
                     f"({type(value).__name__}) for the repeated images")
