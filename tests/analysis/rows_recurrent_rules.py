"""Rule rows of analysis/recurrent_rules.py: the causal convolution, the gated delta rule and the Mamba-2 scan of hybrid layers
(``test_token_rules.TABLES`` runs them). Written in the row language of ``rule_rows.py``.
"""

from __future__ import annotations

import torch

from dualkv_compile.analysis.recurrent_rules import GATED_DELTA, MAMBA1, MAMBA2
from dualkv_compile.ops.forest_recurrent import causal_conv1d

from .rule_rows import B, D, NONE, S, TOKEN, In, X, X0, X1, X2, X3, X4, fails, fn, out

C, K, H = 6, 3, 2
IMPL = "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"
MAMBA2_IMPL = "transformers.models.mamba2.modeling_mamba2.mamba2_chunk_scan"
KDA_IMPL = "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention"
MAMBA1_IMPL = "transformers.models.mamba.modeling_mamba.mamba_selective_scan"



def other_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False):
    """A GDN function the forest reference does not know (its math could be anything)."""
    out = value * torch.sigmoid(g)[..., None] * beta[..., None]
    return out, None


channels_first = In((B, C, S), "b - s", TOKEN)
conv_weight, conv_bias = In((C, 1, K)), In((C,))

CAUSAL_CONV = [
    ("keeps-token-axes", fn(causal_conv1d, X0, X1, None), [channels_first, conv_weight], out("b - s", TOKEN)),
    ("bias", fn(causal_conv1d, X0, X1, X2), [channels_first, conv_weight, conv_bias], out("b - s", TOKEN)),
    ("tokens-not-last", fn(causal_conv1d, X0, X1, None), [In((B, S, C), "b s -", TOKEN), In((S, 1, K))],
     fails("the causal convolution's input laid out")),
    ("next-token-input", fn(causal_conv1d, X0, X1, None), [In((B, C, S - 1), "b - s", TOKEN, shift=1), conv_weight],
     fails("the causal convolution's input laid out")),
    ("token-weight", fn(causal_conv1d, X0, X1, None), [channels_first, In((C, 1, K), "- - -", TOKEN)],
     fails("weight varies with the tokens")),
]

heads = In((B, S, H, D), "b s - -", TOKEN)
gate = In((B, S, H), "b s -", TOKEN, value=-torch.rand(B, S, H))
GATED_DELTA_ROWS = [
    ("keeps-token-axes", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, False, True, IMPL),
     [heads, heads, heads, gate, gate], out("b s - -", TOKEN)),
    ("final-state", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, True, True, IMPL),
     [heads, heads, heads, gate, gate], fails("cached state")),
    ("initial-state", fn(GATED_DELTA, X0, X1, X2, X3, X4, X(5), 64, False, True, IMPL),
     [heads, heads, heads, gate, gate, In((B, H, D, D))], fails("cached state")),
    ("other-impl", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, False, True, f"{__name__}.other_gated_delta_rule"),
     [heads, heads, heads, gate, gate], fails("no forest form")),
    ("kda-channel-gate", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, False, True, KDA_IMPL),
     [heads, heads, heads, In((B, S, H, D), "b s - -", TOKEN, value=-torch.rand(B, S, H, D)), gate],
     out("b s - -", TOKEN)),
    ("kda-constant-gate", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, False, True, KDA_IMPL),
     [heads, heads, heads, In((B, S, H, D), "- - - -", NONE, value=-torch.rand(B, S, H, D)), gate],
     fails("the gated delta rule's g laid out")),
    ("constant-values", fn(GATED_DELTA, X0, X1, X2, X3, X4, None, 64, False, True, IMPL),
     [heads, heads, In((B, S, H, D), "- - - -", NONE), gate, gate], fails("the gated delta rule's v laid out")),
]

def other_mamba2_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf"))):
    """A Mamba-2 scan the forest reference does not know (its math could be anything)."""
    return hidden_states.float() * dt[..., None].float()


ssm_heads = In((B, S, H, D), "b s - -", TOKEN)
ssm_groups = In((B, S, 1, D), "b s - -", TOKEN)
ssm_dt = In((B, S, H), "b s -", TOKEN)
per_head = In((H,), value=-torch.rand(H) - 0.5)
INF = float("inf")


def _scan(*operands, impl=MAMBA2_IMPL):
    """``dualkv::mamba2_chunk_scan`` on x, dt, A, B, C, D, dt_bias (``X0``...), chunks of 4, softplus, no limit."""
    return fn(MAMBA2, *operands, 4, True, 0.0, INF, impl)


MAMBA2_ROWS = [
    ("keeps-token-axes", _scan(X0, X1, X2, X3, X4, X(5), X(6)),
     [ssm_heads, ssm_dt, per_head, ssm_groups, ssm_groups, In((H,)), In((H,))], out("b s - -", TOKEN)),
    ("no-D-no-bias", _scan(X0, X1, X2, X3, X4, None, None),
     [ssm_heads, ssm_dt, per_head, ssm_groups, ssm_groups], out("b s - -", TOKEN)),
    ("other-impl", _scan(X0, X1, X2, X3, X4, None, None, impl=f"{__name__}.other_mamba2_scan"),
     [ssm_heads, ssm_dt, per_head, ssm_groups, ssm_groups], fails("no forest form")),
    ("token-A", _scan(X0, X1, X2, X3, X4, None, None),
     [ssm_heads, ssm_dt, In((B, S, H), "b s -", TOKEN), ssm_groups, ssm_groups], fails("A varies with the tokens")),
    ("constant-B", _scan(X0, X1, X2, X3, X4, None, None),
     [ssm_heads, ssm_dt, per_head, In((B, S, 1, D), "- - - -", NONE), ssm_groups], fails("the Mamba-2 scan's B laid out")),
    ("next-token-dt", _scan(X0, X1, X2, X3, X4, None, None),
     [ssm_heads, In((B, S, H), "b s -", TOKEN, shift=1), per_head, ssm_groups, ssm_groups],
     fails("the Mamba-2 scan's dt laid out")),
]


def other_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         return_last_state=False, use_mambapy=False, use_associative_scan=False):
    """A selective scan the forest reference does not know."""
    return hidden_states * dt


channels = In((B, C, S), "b - s", TOKEN)
s6_state = In((B, D, S), "b - s", TOKEN)
s6_A = In((C, D), value=-torch.rand(C, D) - 0.5)


def _s6(*operands, impl=MAMBA1_IMPL):
    """``dualkv::mamba_selective_scan`` on x, dt, A, B, C, D, z, delta_bias (``X0``...), softplus."""
    return fn(MAMBA1, *operands, True, False, False, impl)


MAMBA1_ROWS = [
    ("keeps-token-axes", _s6(X0, X1, X2, X3, X4, X(5), X(6), X(7)),
     [channels, channels, s6_A, s6_state, s6_state, In((C,)), channels, In((C,))], out("b - s", TOKEN)),
    ("no-D-z-bias", _s6(X0, X1, X2, X3, X4, None, None, None),
     [channels, channels, s6_A, s6_state, s6_state], out("b - s", TOKEN)),
    ("other-impl", _s6(X0, X1, X2, X3, X4, None, None, None, impl=f"{__name__}.other_selective_scan"),
     [channels, channels, s6_A, s6_state, s6_state], fails("no forest form")),
    ("token-A", _s6(X0, X1, X2, X3, X4, None, None, None),
     [channels, channels, In((C, D), "- -", TOKEN, value=-torch.rand(C, D)), s6_state, s6_state],
     fails("A varies with the tokens")),
    ("next-token-inputs", _s6(X0, X1, X2, X3, X4, None, None, None),
     [In((B, C, S - 1), "b - s", TOKEN, shift=1), In((B, C, S - 1), "b - s", TOKEN, shift=1), s6_A,
      In((B, D, S - 1), "b - s", TOKEN, shift=1), In((B, D, S - 1), "b - s", TOKEN, shift=1)],
     fails("the Mamba selective scan's x laid out")),
    ("constant-z", _s6(X0, X1, X2, X3, X4, None, X(5), None),
     [channels, channels, s6_A, s6_state, s6_state, In((B, C, S), "- - -", NONE)],
     fails("the Mamba selective scan's z laid out")),
]
