"""Vision-language models: each distinct image once through the vision tower, the language model packed
(docs/design.md, semantics 17).

CPU, float32, against the unmodified model (a copy, run eagerly): logits at every valid position and every
parameter's gradient (the vision tower's included) within 1e-5; the tower's patch count (a hook on its input) is the
distinct images' patches; the language model's graph runs packed.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dualkv_compile
from dualkv_compile import reports

from tests.vlm_batch import batch, images, tiny_vlm

pytest.importorskip("transformers")

TOL = 1e-5


def _loss(model, b):
    out = model(**b.kwargs())
    w = torch.linspace(-1.0, 1.0, out.logits.shape[-1], device=out.logits.device)
    return (out.logits * w * b.attention_mask[..., None]).sum() / b.attention_mask.sum(), out.logits


def _tower_patches(model) -> list[int]:
    seen = []
    model.model.visual.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(int(args[0].shape[0])),
                                                 with_kwargs=True)
    return seen


def _check(family: str, batches, tower_backend="eager", reset_each=False):
    torch._dynamo.reset()
    model = tiny_vlm(family)
    ref = copy.deepcopy(model)
    counter = dualkv_compile.images_once(model, backend=tower_backend)
    seen = _tower_patches(model)
    compiled = torch.compile(model, backend="dualkv")
    for b in batches:
        if reset_each:
            torch._dynamo.reset()
        before = sum(r.packed_calls for r in reports())
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss_ref, logits_ref = _loss(ref, b)
        loss_ref.backward()
        seen.clear()
        loss, logits = _loss(compiled, b)
        loss.backward()
        assert sum(seen) == b.distinct_patches, (seen, b.distinct_patches)
        valid = b.attention_mask.bool()
        assert (logits[valid] - logits_ref[valid]).abs().max().item() <= TOL
        assert abs(loss.item() - loss_ref.item()) <= TOL
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g_ref = grads[name].grad
            assert (p.grad is None) == (g_ref is None), name
            if p.grad is not None:
                err = (p.grad - g_ref).abs().max().item()
                assert err <= TOL * max(1.0, g_ref.abs().max().item()), (name, err)
        assert sum(r.packed_calls for r in reports()) > before, "no graph ran packed"
    assert counter.images < counter.images_in


def test_qwen2_5_vl_images_once_and_packed():
    imgs = images(3)
    _check("qwen2_5_vl", [
        # Two groups, each its own image and prompt.
        batch([([1, 2], [0], [5, 6, 7]), ([3, 2], [1], [8, 9])], imgs, group_size=3),
        # Two groups whose prompts share an image but differ in text, rows shuffled.
        batch([([1, 2], [2], [5, 6, 7]), ([4], [2], [8, 9, 9, 9])], imgs, group_size=3, seed=1, shuffle=True),
        # Two images per prompt.
        batch([([1], [0, 1], [5, 6]), ([3, 3], [2, 0], [8])], imgs, group_size=2, seed=2, shuffle=True),
    ])


def test_qwen3_vl_images_once_and_packed():
    imgs = images(3, seed=3)
    _check("qwen3_vl", [
        batch([([1, 2], [0], [5, 6, 7]), ([3, 2], [1], [8, 9])], imgs, group_size=3, shuffle=True),
        batch([([1, 2], [2], [5, 6, 7]), ([4], [2], [8, 9, 9, 9])], imgs, group_size=3, seed=1, shuffle=True),
        batch([([1], [0, 1], [5, 6]), ([3, 3], [2, 0], [8])], imgs, group_size=2, seed=2, shuffle=True),
    ], tower_backend="aot_eager", reset_each=True)
    # The tower compiled from the wrapper. Each batch compiled afresh: on transformers 5.24 a third shape in one
    # process sends Qwen3-VL's frames that start at ``deprecate_kwarg``'s shared wrapper past Dynamo's recompile limit
    # (8; plain torch.compile too: the model's graph breaks make each decorated function a frame of that one code
    # object), after which they run eagerly, unpacked (docs/supported.md).


def test_images_once_refuses_a_text_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="no module with get_image_features"):
        dualkv_compile.images_once(model)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        dualkv_compile.images_once(object())


def test_images_once_twice_is_one_wrapper():
    model = tiny_vlm("qwen2_5_vl")
    first = dualkv_compile.images_once(model)
    assert dualkv_compile.images_once(model) is first
    assert dualkv_compile.images_once(model.model) is first
    assert first.wrapped == ("model.get_image_features", "model.get_video_features")


def test_images_once_on_a_tower_of_image_batches():
    """Gemma 3's tower takes ``[N, C, H, W]`` images and no grid (``get_image_features(pixel_values, **kwargs)``):
    ``images_once`` runs it on the distinct images (the first axis) and hands each row its image's features; logits
    and every gradient equal the unwrapped model's (eager: Gemma 3's language model is not packed yet, its image
    merge ``masked_scatter`` has no token-axis rule)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, num_channels=3),
        mm_tokens_per_image=4, image_token_index=120, boi_token_index=121, eoi_token_index=122)
    cfg._attn_implementation = "eager"
    model = Gemma3ForConditionalGeneration(cfg).float()
    ref = copy.deepcopy(model)
    rows = [[2, 121] + [120] * 4 + [122, 5 + g, 6] + list(range(10, 12 + r)) for g in range(2) for r in range(3)]
    ids = torch.zeros(6, max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    kwargs = dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(2, 3, 28, 28)[[0, 0, 0, 1, 1, 1]],
                  token_type_ids=(ids == 120).long())
    counter = dualkv_compile.images_once(model, backend=None)
    seen = []
    model.model.vision_tower.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(int(kw["pixel_values"].shape[0])), with_kwargs=True)
    out, want = model(**kwargs).logits, ref(**kwargs).logits
    assert seen == [2] and (counter.images_in, counter.images) == (6, 2)
    valid = mask.bool()
    assert (out[valid] - want[valid]).abs().max().item() <= TOL
    w = torch.linspace(-1.0, 1.0, out.shape[-1])
    (out[valid] @ w).sum().backward()
    (want[valid] @ w).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= TOL * max(1.0, q.grad.abs().max().item()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen2_5_vl_packs_on_cuda():
    """On a GPU, float32: the tiny Qwen2.5-VL under dualkv (images_once, the GPU attention kernels) against the float64
    model: logits and every gradient, by relative norm, at most twice as far from it as the unmodified float32
    model is."""
    torch._dynamo.reset()
    model = tiny_vlm("qwen2_5_vl").cuda()
    plain, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    b = batch([([1, 2], [0], [5, 6, 7]), ([4], [1], [8, 9, 9])], images(2), group_size=3, shuffle=True)
    for f in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        setattr(b, f, getattr(b, f).cuda())
    dualkv_compile.images_once(model, backend="inductor")
    before = sum(r.packed_calls for r in reports())
    loss, logits = _loss(torch.compile(model, backend="dualkv"), b)
    loss.backward()
    assert sum(r.packed_calls for r in reports()) > before, "no graph ran packed"
    loss_p, logits_p = _loss(plain, b)
    loss_p.backward()
    b.pixel_values = b.pixel_values.double()
    loss_e, logits_e = _loss(exact, b)
    loss_e.backward()
    valid = b.attention_mask.bool()

    def rel(x, y):
        return ((x.double() - y).norm() / y.norm().clamp_min(1e-30)).item()

    errs = {"logits": (rel(logits[valid], logits_e[valid]), rel(logits_p[valid], logits_e[valid]))}
    for (name, p), q, e in zip(model.named_parameters(), plain.parameters(), exact.parameters()):
        if e.grad is not None:
            errs[name] = (rel(p.grad, e.grad), rel(q.grad, e.grad))
    worst = max(errs, key=lambda k: errs[k][0])
    print(f"largest error against float64: {worst} dualkv {errs[worst][0]:.2e}, plain float32 {errs[worst][1]:.2e}")
    # No worse than the unmodified float32 model (its CUDA kernels are themselves ~2e-4 off float64 here).
    assert all(d <= max(1e-5, 2 * p) for d, p in errs.values()), errs
