"""Prepared components: the smallest modules a recipe replaces, plus in-graph sampling."""

from __future__ import annotations

import torch

# The tags of Flare's per-layer ops that take a step's shared inputs (page tables, sequence
# lengths, slots, rotary tables, state rows: attention, KV writes, gated-delta decode, state
# scatters), computed once per step in the traced forward.
# Without them the compiler gives each call of a custom op its input laid out exactly as eager
# would: an input not yet stored is copied for that call, recomputed from its producers. That
# was one extra kernel per layer per step (a decode step's gathers, `q_pos + 1` and rotary
# cos/sin, ~1.2 µs a layer on an H100). With a flexible layout the compiler stores each such
# input once, in its own layout, and every layer reads that buffer; the ops accept any layout
# (`launch.unit_stride`). The sampling's top-k carries it too: its input (the penalised logits)
# is also read by the full-vocabulary path's sort.
SHARED_STEP_INPUTS = (torch.Tag.flexible_layout,)
