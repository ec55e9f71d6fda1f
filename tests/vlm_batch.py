"""Tiny Qwen2.5-VL / Qwen3-VL models and GRPO-style batches of prompts with images, for the vision-language tests.

A prompt is text, then for each of its images ``<vision_start>``, one placeholder per merged token, ``<vision_end>``,
then text; each row is its group's prompt and a response of its own; rows right-padded (TRL's and veRL's left-padded
prompts go through the same layout code as the text tests'). ``pixel_values`` holds every row's images again,
as TRL and veRL pass them.
"""

from __future__ import annotations

import dataclasses

import torch

IMAGE, VIDEO, START, END = 120, 121, 122, 123
VOCAB = 128
GRID = (1, 8, 8)  # t, h, w patches of one image: 64 patches, 16 merged tokens
PATCH_DIM = 3 * 1 * 2 * 2  # channels * temporal * patch * patch


def tiny_vlm(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, out_hidden_size=64, in_channels=3)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, window_size=8, fullatt_block_indexes=[1]),
                               **tokens)
        cls = Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text["head_dim"] = 16
        text["rope_parameters"]["mrope_interleaved"] = True
        cfg = Qwen3VLConfig(text_config=text, vision_config=dict(vision, num_position_embeddings=16,
                                                                 deepstack_visual_indexes=[0]), **tokens)
        cls = Qwen3VLForConditionalGeneration
    else:
        raise ValueError(f"family: expected 'qwen2_5_vl' or 'qwen3_vl', got {family!r}")
    cfg._attn_implementation = "sdpa"
    return cls(cfg).float().eval()


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    mm_token_type_ids: torch.Tensor
    distinct_patches: int

    def kwargs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, pixel_values=self.pixel_values,
                    image_grid_thw=self.image_grid_thw, mm_token_type_ids=self.mm_token_type_ids)


def batch(prompts: list[tuple[list[int], list[int], list[int]]], images: list[torch.Tensor], group_size: int,
          seed: int = 0, shuffle: bool = False) -> Batch:
    """``prompts``: per group (text before, the indices of its images in ``images``, text after); ``group_size`` rows
    each with responses of different lengths; ``shuffle`` puts the rows in a random order."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = GRID
    merged = t * h * w // 4
    rows, pix = [], []
    for before, image_ids, after in prompts:
        prompt = list(before)
        for i in image_ids:
            prompt += [START] + [IMAGE] * merged + [END]
        prompt += list(after)
        for r in range(group_size):
            response = torch.randint(10, 100, (2 + r,), generator=g).tolist()
            rows.append((prompt + response, [images[i] for i in image_ids]))
    if shuffle:
        rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    S = max(len(r) for r, _ in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, (r, imgs) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        pix += imgs
    used = {i for _, ims, _ in prompts for i in ims}
    return Batch(ids, mask, torch.cat(pix), torch.tensor([list(GRID)] * len(pix)), (ids == IMAGE).long(),
                 distinct_patches=len(used) * t * h * w)


def images(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(GRID[0] * GRID[1] * GRID[2], PATCH_DIM, generator=g) for _ in range(n)]
